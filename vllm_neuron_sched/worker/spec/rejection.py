"""Rejection sampling of a verify step's drafts (greedy and random, vLLM's
rule) and the logprobs of the tokens it accepts.

Rejection sampling is a device program of fixed signature (``accept_drafts``):
tensors of the step's declared shape in, ``[rows, width]`` tokens out, no
host read, no shape that depends on the drafts found. What is per request
Python (a seeded request's generator) runs before it, in ``draw_randomness``,
and enters as tensors of a fixed shape."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_neuron_sched.worker.sampling import (
    GREEDY_TEMPERATURE,
    logprobs_scores,
    sampling_scaled,
)

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.worker.programs import Programs


# Rejected positions in the rejection sampler's output.
REJECTED = -1


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
    processed = constrained_logits.float()
    if mode.startswith("processed") and not metadata.all_greedy:
        assert metadata.temperature is not None
        processed = sampling_scaled(
            processed, width, metadata.temperature, metadata.top_k, metadata.top_p
        )
    scores = logprobs_scores(raw_logits, processed, mode)
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


@dataclass(frozen=True)
class Randomness:
    """What a verify step's random rows draw: one exponential per vocabulary
    entry for the bonus token (as vLLM's sampler draws for a token), then
    ``K`` (the configured number of drafts) uniforms and one exponential per
    vocabulary entry a row, however many drafts the row or the step has: so
    a seeded request's generator moves the same whatever batch it is in, and
    the program's shapes are fixed."""

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor | None  # [rows] int32
    top_p: torch.Tensor | None  # [rows] float32
    bonus_noise: torch.Tensor  # [rows, vocab]
    uniforms: torch.Tensor  # [rows, K]
    noise: torch.Tensor  # [rows, vocab]


def draw_randomness(
    metadata: "SamplingMetadata", num_drafts: int, vocab: int, noise_dtype: torch.dtype
) -> Randomness | None:
    """Host side, at enqueue: the per-request step before ``accept_drafts``
    (the generators are host objects, drawn from in step order by the host
    thread alone): each seeded row draws from its own generator, the others
    from torch's, the bonus token's noise first. None when every row is
    greedy. Top-k and top-p come both or
    neither (a row without one keeps the whole vocabulary, vLLM's own
    filling), so the program has two random variants, not four."""
    if metadata.all_greedy:
        return None
    assert metadata.temperature is not None
    rows = metadata.temperature.shape[0]
    generators = metadata.generators
    bonus_noise = torch.empty((rows, vocab), dtype=noise_dtype)
    if len(generators) != rows:
        bonus_noise.exponential_()
    for row, generator in generators.items():
        bonus_noise[row].exponential_(generator=generator)
    uniforms = torch.rand(rows, num_drafts)
    noise = torch.empty((rows, vocab), dtype=noise_dtype).exponential_()
    for row, generator in generators.items():
        uniforms[row] = torch.rand(num_drafts, generator=generator)
        noise[row].exponential_(generator=generator)
    top_k, top_p = metadata.top_k, metadata.top_p
    if top_k is None and top_p is not None:
        top_k = torch.full((rows,), vocab, dtype=torch.int32)
    if top_p is None and top_k is not None:
        top_p = torch.ones(rows, dtype=torch.float32)
    return Randomness(metadata.temperature, top_k, top_p, bonus_noise, uniforms, noise)


def rejection_sample(
    logits: torch.Tensor,
    width: int,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    random: Randomness | None,
    programs: "Programs",
) -> torch.Tensor:
    """Speculative rejection sampling for drafts without probabilities
    (n-gram: the draft distribution is one-hot). ``logits``: [rows * width,
    vocab], row r's queries at ``r * width``; ``drafts``: [rows, K]. Returns
    [rows, width] tokens: each row's accepted drafts, then one token (the
    first rejection's replacement, or the bonus), then ``REJECTED``.

    vLLM's rejection sampler computes the same, but its CPU kernels corrupt
    random sampling in vLLM 0.32 (its ``expand`` replacement copies 8 bytes
    per element; the random kernel returns an accepted draft with no token
    after it), so this is plain torch: one program (``accept_drafts``), after
    the host's draws (``random``: ``draw_randomness``, at enqueue).
    """
    rows = num_drafts.shape[0]
    queries = logits.reshape(rows, width, -1)
    return programs.accept_drafts(queries, drafts, num_drafts, random)


def accept_drafts(
    queries: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    random: Randomness | None,
) -> torch.Tensor:
    """The device program: ``queries`` [rows, width, vocab] float32 (the
    constrained logits), ``drafts`` [rows, K], ``num_drafts`` [rows] (how
    many of them the row verifies) -> [rows, width] int32.

    A greedy row accepts a draft while it is the target's argmax and then
    takes the argmax (vLLM's greedy rule, so tokens equal stock vLLM's). A
    random row accepts draft d with probability p(d) under the target's
    temperature, top-k and top-p, and on rejection takes a token drawn from
    p with d removed, which leaves the output distributed as p. After every
    draft the bonus token is sampled as vLLM's sampler samples a token: the
    argmax, or a draw from p (the Gumbel-max trick with the row's bonus
    noise). Every query is judged and the rows' counts select the answer
    (masks, no gathers of a data-dependent size)."""
    rows, width, _ = queries.shape
    k = width - 1
    bonus = _bonus(queries, num_drafts, random)
    out = torch.full((rows, width), REJECTED, dtype=torch.int32)
    if not k:
        out[:, 0] = bonus
        return out
    target = queries[:, :k]
    draft_ids = drafts[:, :k].long()
    recovered = target.argmax(dim=-1)  # [rows, k]
    accept = recovered == draft_ids
    if random is not None:
        random_accept, random_recovered = _random_rule(target, draft_ids, random)
        is_greedy = (random.temperature < GREEDY_TEMPERATURE)[:, None]
        accept = torch.where(is_greedy, accept, random_accept)
        recovered = torch.where(is_greedy, recovered, random_recovered)
    offsets = torch.arange(k)
    is_draft = offsets[None, :] < num_drafts[:, None]
    num_accepted = (accept & is_draft).long().cumprod(dim=1).sum(dim=1)
    out[:, :k] = torch.where(
        offsets[None, :] < num_accepted[:, None], draft_ids.int(), REJECTED
    )
    last = torch.where(
        num_accepted < num_drafts,
        recovered.gather(1, num_accepted.clamp(max=k - 1)[:, None])[:, 0],
        bonus,
    )
    out.scatter_(1, num_accepted[:, None], last[:, None].to(torch.int32))
    return out


def _bonus(
    queries: torch.Tensor, num_drafts: torch.Tensor, random: Randomness | None
) -> torch.Tensor:
    """[rows] int64: the token after each row's drafts, from the query that
    follows its last one: the argmax for a greedy row, a draw from the
    scaled distribution for a random one (vLLM's ``random_sample``)."""
    vocab = queries.shape[2]
    index = num_drafts.long()[:, None, None].expand(-1, 1, vocab)
    query = queries.gather(1, index)[:, 0]  # [rows, vocab]
    greedy = query.argmax(dim=-1)
    if random is None:
        return greedy
    probs = sampling_scaled(
        query, 1, random.temperature, random.top_k, random.top_p
    ).softmax(dim=-1, dtype=torch.float32)
    drawn = (probs.to(random.bonus_noise.dtype) / random.bonus_noise).argmax(dim=-1)
    return torch.where(random.temperature < GREEDY_TEMPERATURE, greedy, drawn)


def _random_rule(
    target: torch.Tensor, draft_ids: torch.Tensor, random: Randomness
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query [rows, k]: its draft accepted with probability p(draft),
    and the token drawn from p without the draft (the replacement if it is
    rejected), with the row's exponentials (the Gumbel-max trick)."""
    rows, k, vocab = target.shape
    probs = sampling_scaled(
        target.reshape(rows * k, vocab),
        k,
        random.temperature,
        random.top_k,
        random.top_p,
    ).softmax(dim=-1)
    probs = probs.view(rows, k, vocab)
    accept = random.uniforms[:, :k] < probs.gather(2, draft_ids[..., None])[..., 0]
    residual = probs.scatter(2, draft_ids[..., None], 0.0)
    return accept, (residual / random.noise[:, None, :]).argmax(dim=-1)
