"""Rejection sampling of a verify step's drafts (greedy and random, vLLM's
rule) and the logprobs of the tokens it accepts."""

from typing import TYPE_CHECKING

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import generate_uniform_probs

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler


# Rejected positions in the rejection sampler's output.
REJECTED = -1


# A row whose temperature is below this samples greedily (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5


def verify_logprobs(
    sampler: "Sampler",
    raw_logits: torch.Tensor,
    constrained_logits: torch.Tensor,
    tokens: torch.Tensor,
    metadata: "SamplingMetadata",
) -> LogprobsTensors:
    """Logprobs of every query of a verify step (logits: [rows * width,
    vocab]; ``tokens``: [rows, width], what it output, ``REJECTED`` past each
    row's run), each row's ``width`` entries at ``row * width``: the
    scheduler keeps a row's first as many as it output. As vLLM's rejection
    sampler reports them, in the sampler's logprobs mode: the raw modes read
    the logits as the forward gave them; the processed modes read them after
    ``constrain_verify_logits``, then, unless every row is greedy, after
    temperature, top-k and top-p (``sampling_scaled``), at the drafts'
    queries as at the bonus token's."""
    mode = sampler.logprobs_mode
    rows, width = tokens.shape
    processed = mode.startswith("processed")
    scores = (constrained_logits if processed else raw_logits).float()
    if processed and not metadata.all_greedy:
        row_of = torch.arange(rows).repeat_interleave(width)
        scores = sampling_scaled(scores, metadata, row_of)
    if mode.endswith("logprobs"):
        scores = sampler.compute_logprobs(scores)
    ids = tokens.flatten().clamp(min=0).long()
    assert metadata.max_num_logprobs is not None
    token_ids, values, ranks, *_ = sampler.gather_logprobs(
        scores, metadata.max_num_logprobs, ids
    )
    return LogprobsTensors(
        token_ids,
        values,
        ranks,
        cu_num_generated_tokens=list(range(0, rows * width + 1, width)),
    )


def sampling_scaled(
    logits: torch.Tensor, metadata: "SamplingMetadata", row_of: torch.Tensor
) -> torch.Tensor:
    """``logits`` (a new tensor) divided by their rows' temperatures (1 for
    greedy rows) and masked to their top-k and top-p: the distribution a
    random row samples from, and vLLM's processed logits. ``row_of``: the
    batch row of each of ``logits``' rows."""
    assert metadata.temperature is not None
    temperature = metadata.temperature[row_of]
    temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    return apply_top_k_top_p(
        logits / temperature[:, None].float(),
        None if metadata.top_k is None else metadata.top_k[row_of],
        None if metadata.top_p is None else metadata.top_p[row_of],
    )


def rejection_sample(
    sampler: "Sampler",
    logits: torch.Tensor,
    width: int,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    metadata: "SamplingMetadata",
) -> torch.Tensor:
    """Speculative rejection sampling for drafts without probabilities
    (n-gram: the draft distribution is one-hot). ``logits``: [rows * width,
    vocab], row r's queries at ``r * width``. Returns [rows, width] tokens:
    each row's accepted drafts, then one token (the first rejection's
    replacement, or the bonus), then ``REJECTED``.

    A greedy row accepts a draft while it is the target's argmax and then
    takes the argmax (vLLM's greedy rule, so tokens equal stock vLLM's). A
    random row accepts draft d with probability p(d) under the target's
    temperature, top-k and top-p, and on rejection samples from p with d
    removed, which leaves the output distributed as p. Seeded rows draw from
    their own generators. vLLM's rejection sampler computes the same, but its
    CPU kernels corrupt random sampling in vLLM 0.32 (its ``expand``
    replacement copies 8 bytes per element; the random kernel returns an
    accepted draft with no token after it), so this is plain torch.
    """
    rows = num_drafts.shape[0]
    row_starts = torch.arange(rows) * width
    bonus = sampler(
        logits=logits[row_starts + num_drafts], sampling_metadata=metadata
    ).sampled_token_ids[:, 0]
    out = torch.full((rows, width), REJECTED, dtype=torch.int32)
    counts = num_drafts.tolist()
    k = width - 1
    if not k or not any(counts):
        out[:, 0] = bonus
        return out
    offsets = torch.arange(k)
    is_draft = offsets[None, :] < num_drafts[:, None]  # [rows, k]
    target = logits[(row_starts[:, None] + offsets)[is_draft]].float()  # [T, V]
    draft_ids = drafts[:, :k][is_draft].long()
    recovered = target.argmax(dim=-1)
    accept = recovered == draft_ids
    if not metadata.all_greedy:
        row_of = torch.arange(rows).repeat_interleave(num_drafts)
        is_greedy = (metadata.temperature < GREEDY_TEMPERATURE)[row_of]
        random_accept, random_recovered = _random_rule(
            sampler, target, draft_ids, row_of, counts, metadata
        )
        accept = torch.where(is_greedy, accept, random_accept)
        recovered = torch.where(is_greedy, recovered, random_recovered)
    _fill_rows(out, drafts, num_drafts, is_draft, accept, recovered, bonus)
    return out


def _fill_rows(
    out: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    is_draft: torch.Tensor,
    accept: torch.Tensor,
    recovered: torch.Tensor,
    bonus: torch.Tensor,
) -> None:
    """Each row of ``out``: its leading run of accepted drafts, then the
    first rejected draft's replacement, or the bonus token when all were
    accepted. ``accept`` and ``recovered``: per draft (``is_draft``)."""
    rows, k = is_draft.shape
    accepted = torch.zeros((rows, k), dtype=torch.int64)
    accepted[is_draft] = accept.long()
    replacement = torch.zeros((rows, k), dtype=torch.int64)
    replacement[is_draft] = recovered
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # the leading run
    out[:, :k] = torch.where(
        torch.arange(k)[None, :] < num_accepted[:, None], drafts[:, :k], REJECTED
    )
    last = torch.where(
        num_accepted < num_drafts,
        replacement.gather(1, num_accepted.clamp(max=k - 1)[:, None])[:, 0],
        bonus.long(),
    )
    out.scatter_(1, num_accepted[:, None], last[:, None].to(torch.int32))


def _random_rule(
    sampler: "Sampler",
    target: torch.Tensor,
    draft_ids: torch.Tensor,
    row_of: torch.Tensor,
    counts: list[int],
    metadata: "SamplingMetadata",
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each draft [T]: accepted with probability p(draft), and the token
    drawn from p without the draft (the replacement if it is rejected)."""
    probs = sampling_scaled(target, metadata, row_of).softmax(dim=-1)
    uniform = generate_uniform_probs(
        draft_ids.shape[0], counts, metadata.generators, probs.device
    )
    accept = uniform < probs.gather(1, draft_ids[:, None])[:, 0]
    residual = probs.scatter(1, draft_ids[:, None], 0.0)
    noise_dtype = torch.float64 if sampler.use_fp64_gumbel else torch.float32
    rows = len(counts)
    noise = torch.empty((rows, probs.shape[1]), dtype=noise_dtype).exponential_()
    for row, generator in metadata.generators.items():
        if counts[row]:
            noise[row].exponential_(generator=generator)
    return accept, (residual / noise[row_of]).argmax(dim=-1)
