"""What vLLM's sampler applies before sampling, applied to a verify step's
logits (penalties, bad words, min_tokens, logits processors), so drafts are
verified against the distribution a plain step would sample from. The
penalties and bad words are ``history_rules.py``'s programs, at ``1 + K``
queries per row."""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.programs import Programs
    from vllm_neuron_sched.worker.spec.verify import VerifyPlan
    from vllm_neuron_sched.worker.token_table import DeviceTokens


def constrain_verify_logits(
    logits: torch.Tensor,
    plan: "VerifyPlan",
    tokens: "DeviceTokens",
    metadata: "SamplingMetadata",
    programs: "Programs",
) -> "tuple[torch.Tensor, SamplingMetadata]":
    """Device side: the allowed-token masks, min_tokens' stop masks, bad words
    and the penalties at every query of a verify step, and the metadata left
    for the sampler (without them).

    Query ``j`` of a row predicts the token after its ``j`` drafts, so its
    constraints see the row's output so far and those drafts, all read from
    the device history: under async scheduling the host's lists still hold
    placeholders. vLLM's ``apply_penalties`` does the arithmetic, as in stock
    sampling; vLLM's own rejection sampler counts the drafts the same way."""
    mask = metadata.allowed_token_ids_mask
    bad_words = plan.bad_words
    if (
        metadata.no_penalties
        and mask is None
        and not plan.min_tokens
        and bad_words is None
    ):
        return logits, metadata
    rows, width = plan.num_rows, plan.width
    queries = logits.view(rows, width, -1)
    lengths = tokens.lengths_of(plan.slots)
    ends = lengths[:, None] + torch.arange(width)[None, :]  # j drafts past them
    if mask is not None:
        queries = queries.masked_fill(mask[:rows, None, :], float("-inf"))
    history = None
    if bad_words is not None or not metadata.no_penalties:
        history = _histories_with_drafts(plan, tokens, lengths)
    if bad_words is not None:
        assert history is not None
        queries = programs.mask_bad_words(
            queries, history, ends, plan.prompt_lens, bad_words
        )
    # Last of the masks: whether a structured query has a token left is
    # decided over all of them (vLLM's order: its min_tokens processor runs
    # after the allowed tokens and the bad words).
    queries = _mask_min_tokens(queries, plan, lengths, programs)
    if not metadata.no_penalties:
        assert history is not None
        queries = programs.penalize_queries(
            queries,
            history,
            ends,
            plan.prompt_lens,
            metadata.presence_penalties[:rows],
            metadata.frequency_penalties[:rows],
            metadata.repetition_penalties[:rows],
        )
    logits = queries.reshape(rows * width, -1)
    # The sampler (the bonus tokens) must not apply them again; vLLM's
    # min_tokens processor would mask by the host's count, not the query's.
    processors = LogitsProcessors()
    processors.argmax_invariant = list(metadata.logitsprocs.argmax_invariant)
    processors.non_argmax_invariant = [
        p
        for p in metadata.logitsprocs.non_argmax_invariant
        if not isinstance(p, MinTokensLogitsProcessor)
    ]
    return logits, replace(
        metadata,
        no_penalties=True,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=processors,
    )


def _mask_min_tokens(
    queries: torch.Tensor,
    plan: "VerifyPlan",
    lengths: torch.Tensor,
    programs: "Programs",
) -> torch.Tensor:
    """Query j follows the row's outputs and j drafts: its stops are masked
    while those are fewer than min_tokens. The rows' settings are host data
    (``plan.min_tokens``), made tensors here; ``mask_min_tokens`` is the
    program."""
    if not plan.min_tokens:
        return queries
    rows, vocab = plan.num_rows, queries.shape[2]
    wanted = torch.zeros(rows, dtype=torch.int64)
    structured = torch.zeros(rows, dtype=torch.bool)
    stops = torch.zeros(rows, vocab, dtype=torch.bool)
    for row, min_tokens, stop_ids, is_structured in plan.min_tokens:
        wanted[row] = min_tokens
        structured[row] = is_structured
        stops[row, list(stop_ids)] = True
    return programs.mask_min_tokens(
        queries, lengths - plan.prompt_lens, wanted, stops, structured
    )


def mask_min_tokens(
    queries: torch.Tensor,
    num_outputs: torch.Tensor,
    wanted: torch.Tensor,
    stops: torch.Tensor,
    structured: torch.Tensor,
) -> torch.Tensor:
    """The device program: ``queries`` [rows, width, vocab], each row's
    outputs so far and ``min_tokens`` ([rows]), its stop tokens ([rows,
    vocab] bool), whether it has a grammar ([rows]). Query j's stops are
    masked while ``num_outputs + j < min_tokens``. A structured request's
    query whose grammar leaves only stops keeps them (vLLM's rule, as its
    min_tokens processor restores them), or it would have no token."""
    width = queries.shape[1]
    active = torch.arange(width)[None, :] < (wanted - num_outputs)[:, None]
    masked = queries.masked_fill(active[:, :, None] & stops[:, None, :], -torch.inf)
    emptied = torch.isneginf(masked).all(dim=-1) & structured[:, None]
    return torch.where(emptied[:, :, None], queries, masked)


def _histories_with_drafts(
    plan: "VerifyPlan", tokens: "DeviceTokens", lengths: torch.Tensor
) -> torch.Tensor:
    """[rows, token table width + K] int64: each row's known tokens, then its
    drafts. The whole width, not the rows' longest: a fixed shape, and no
    host read of the device's lengths."""
    history = tokens.histories_of(plan.slots).long()
    width = plan.width
    if width > 1:
        history = torch.nn.functional.pad(history, (0, width - 1))
        columns = lengths[:, None] + torch.arange(width - 1)
        history = history.scatter(
            1, columns, tokens.drafts_of(plan.slots, width - 1).long()
        )
    return history
