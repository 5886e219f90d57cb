"""What vLLM's sampler applies before sampling, applied to a verify step's
logits (``logits_rules.py``'s rules at ``1 + K`` queries per row), so
drafts are verified against the distribution a plain step would sample
from; and the metadata the rejection sampler is left with."""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_neuron_sched.worker.logits_rules import (
    QueryPasts,
    any_rule,
    constrain_queries,
    reads_history,
)

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.programs import Programs
    from vllm_neuron_sched.worker.spec.verify import VerifyPlan
    from vllm_neuron_sched.worker.token_table import DeviceTokens


def constrain_verify_logits(
    logits: torch.Tensor,
    plan: "VerifyPlan",
    tokens: "DeviceTokens",
    drafts: torch.Tensor,
    metadata: "SamplingMetadata",
    programs: "Programs",
) -> "tuple[torch.Tensor, SamplingMetadata]":
    """Device side: the rows' rules at every query of a verify step, and the
    metadata left for the sampler (without them).

    Query ``j`` of a row predicts the token after its ``j`` drafts, so its
    rules see the row's output so far and those drafts, all read from the
    device history: under async scheduling the host's lists still hold
    placeholders. vLLM's own rejection sampler counts the drafts the same
    way."""
    if not any_rule(plan.rules, metadata):
        return logits, metadata
    rows, width = plan.num_rows, plan.width
    history, lengths = tokens.histories_of(plan.slots)
    pasts = QueryPasts(
        _histories_with_drafts(plan.width, history, lengths, drafts)
        if reads_history(plan.rules, metadata)
        else None,
        lengths[:, None] + torch.arange(width)[None, :],  # j drafts past them
        plan.prompt_lens,
    )
    queries = constrain_queries(
        programs, logits.view(rows, width, -1), plan.rules, metadata, pasts
    )
    logits = queries.reshape(rows * width, -1)
    # The sampler (the bonus tokens) must not apply them again; vLLM's
    # min_tokens processor would mask by the host's count, not the query's.
    processors = LogitsProcessors()
    processors.argmax_invariant = list(metadata.logitsprocs.argmax_invariant)
    processors.non_argmax_invariant = [
        p
        for p in metadata.logitsprocs.non_argmax_invariant
        if not isinstance(p, (MinTokensLogitsProcessor, LogitBiasLogitsProcessor))
    ]
    return logits, replace(
        metadata,
        no_penalties=True,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=processors,
    )


def _histories_with_drafts(
    width: int, history: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """[rows, token table width + K] int64: each row's known tokens, then its
    first ``width - 1`` drafts. The whole width, not the rows' longest: a
    fixed shape, and no host read of the device's lengths."""
    history = history.long()
    if width > 1:
        history = torch.nn.functional.pad(history, (0, width - 1))
        columns = lengths[:, None] + torch.arange(width - 1)
        history = history.scatter(1, columns, drafts[:, : width - 1].long())
    return history
