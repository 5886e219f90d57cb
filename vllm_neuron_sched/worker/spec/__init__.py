"""Speculative decoding on a static-shape device, chained on the device.

With ``--speculative-config`` (n-gram prompt lookup, or a draft model:
``spec/draft_model.py``) every decode step is a *verify step*: each decode row
runs ``1 + K`` queries, its newest token and K drafts, at the static shape
``[decode bucket, 1 + K]`` (rows without drafts padded; a step where the
scheduler gave no row a draft runs at ``[bucket, 1]``). Everything the step
needs beyond the block table comes from the device's per-slot state
(``DeviceTokens``): the newest token, the drafts, the number of tokens known
(so the positions and KV slots), because under async scheduling the step
before has not told the host, or the scheduler, how many of its drafts were
accepted. vLLM's scheduler plans with the
optimistic count (all drafts accepted) and corrects it when the output lands;
the device always knows the true one.

On the device, in enqueue order: the verify forward (inputs from the slots,
then the model), then rejection sampling, the accepted tokens into the
histories, and the next drafts proposed from them (``spec/ngram.py``, or the draft
model's forwards). The host learns the accepted tokens when the step retires,
as it learns sampled tokens.
"""
