"""What vLLM's sampler applies before sampling, applied to a verify step's
logits (penalties, bad words, min_tokens, logits processors), so drafts are
verified against the distribution a plain step would sample from."""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.spec.verify import VerifyPlan
    from vllm_neuron_sched.worker.token_table import DeviceTokens


def constrain_verify_logits(
    logits: torch.Tensor,
    plan: "VerifyPlan",
    tokens: "DeviceTokens",
    metadata: "SamplingMetadata",
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
    bad_words = metadata.bad_words_token_ids
    if metadata.no_penalties and mask is None and not plan.min_tokens and not bad_words:
        return logits, metadata
    logits = logits.clone()
    lengths = tokens.lengths_of(plan.slots)
    if mask is not None:
        rows = mask[: plan.num_rows].repeat_interleave(plan.width, 0)
        logits.masked_fill_(rows, float("-inf"))
    if bad_words:
        _mask_bad_words(logits, plan, tokens, lengths, bad_words)
    # Last of the masks: whether a structured query has a token left is
    # decided over all of them (vLLM's order: its min_tokens processor runs
    # after the allowed tokens and the bad words).
    _mask_min_tokens(logits, plan, lengths)
    if not metadata.no_penalties:
        _apply_penalties(logits, plan, tokens, lengths, metadata)
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
    logits: torch.Tensor, plan: "VerifyPlan", lengths: torch.Tensor
) -> None:
    """Query j follows the row's outputs and j drafts: its stops are masked
    while those are fewer than min_tokens. The rows' settings are host data
    (``plan.min_tokens``), made tensors here; ``mask_min_tokens`` is the
    program."""
    if not plan.min_tokens:
        return
    rows, vocab = plan.num_rows, logits.shape[1]
    wanted = torch.zeros(rows, dtype=torch.int64)
    structured = torch.zeros(rows, dtype=torch.bool)
    stops = torch.zeros(rows, vocab, dtype=torch.bool)
    for row, min_tokens, stop_ids, is_structured in plan.min_tokens:
        wanted[row] = min_tokens
        structured[row] = is_structured
        stops[row, list(stop_ids)] = True
    queries = logits.view(rows, plan.width, vocab)
    queries.copy_(
        mask_min_tokens(queries, lengths - plan.prompt_lens, wanted, stops, structured)
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


def _mask_bad_words(
    logits: torch.Tensor,
    plan: "VerifyPlan",
    tokens: "DeviceTokens",
    lengths: torch.Tensor,
    bad_words: dict[int, list[list[int]]],
) -> None:
    """vLLM's rule per query, over the row's outputs and the query's drafts."""
    width = plan.width
    queries: dict[int, list[list[int]]] = {}
    pasts: list[list[int]] = [[] for _ in range(plan.num_rows * width)]
    for row, words in bad_words.items():
        slot = plan.slots[row : row + 1]
        start, end = int(plan.prompt_lens[row]), int(lengths[row])
        outputs = tokens.histories_of(slot, end)[0, start:].tolist()
        drafts = tokens.drafts_of(slot, width - 1)[0].tolist()
        for j in range(width):
            queries[row * width + j] = words
            pasts[row * width + j] = outputs + drafts[:j]
    apply_bad_words(logits, queries, pasts)


def _apply_penalties(
    logits: torch.Tensor,
    plan: "VerifyPlan",
    tokens: "DeviceTokens",
    lengths: torch.Tensor,
    metadata: "SamplingMetadata",
) -> None:
    """vLLM's penalties per query: the row's outputs then the query's drafts
    count as its output tokens. Over the whole history width (the token
    table's, plus the drafts'), not the rows' longest: a fixed shape, and no
    host read of the device's lengths."""
    assert metadata.prompt_token_ids is not None
    rows, width, vocab = plan.num_rows, plan.width, logits.shape[1]
    history = tokens.histories_of(plan.slots).long()
    if width > 1:
        history = torch.nn.functional.pad(history, (0, width - 1))
        columns = lengths[:, None] + torch.arange(width - 1)
        history = history.scatter(
            1, columns, tokens.drafts_of(plan.slots, width - 1).long()
        )
    span = history.shape[1]
    position = torch.arange(span)[None, None, :]
    ends = lengths[:, None] + torch.arange(width)[None, :]  # [rows, width]
    is_output = (position >= plan.prompt_lens[:, None, None]) & (
        position < ends[:, :, None]
    )
    outputs = torch.where(is_output, history[:, None, :], vocab)
    apply_penalties(
        logits,
        metadata.prompt_token_ids[:rows].repeat_interleave(width, 0),
        outputs.reshape(rows * width, span),
        metadata.presence_penalties[:rows].repeat_interleave(width),
        metadata.frequency_penalties[:rows].repeat_interleave(width),
        metadata.repetition_penalties[:rows].repeat_interleave(width),
    )
