"""What vLLM's sampler applies before sampling, applied to a verify step's
logits (penalties, bad words, min_tokens, logits processors), so drafts are
verified against the distribution a plain step would sample from."""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.utils.math_utils import next_power_of_2
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
            queries,
            history,
            ends,
            plan.prompt_lens,
            bad_words.words,
            bad_words.lengths,
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


@dataclass(frozen=True)
class BadWords:
    """The rows' bad words as tensors the host prepares (``plan_bad_words``):
    ``words`` [rows, words, length] token ids, each word left-aligned and
    zero-padded, ``lengths`` [rows, words] (0: no word)."""

    words: torch.Tensor
    lengths: torch.Tensor


def plan_bad_words(
    num_rows: int, per_row: dict[int, list[list[int]]]
) -> BadWords | None:
    """Host side: the rows' tokenized bad words (vLLM's
    ``SamplingParams.bad_words_token_ids``) padded to powers of two in count
    and length, so the program runs at one of few shapes whatever the
    requests ask."""
    per_row = {row: words for row, words in per_row.items() if words}
    if not per_row:
        return None
    num_words = next_power_of_2(max(len(words) for words in per_row.values()))
    length = next_power_of_2(max(len(w) for ws in per_row.values() for w in ws))
    words = torch.zeros(num_rows, num_words, length, dtype=torch.int64)
    lengths = torch.zeros(num_rows, num_words, dtype=torch.int64)
    for row, row_words in per_row.items():
        for i, word in enumerate(row_words):
            words[row, i, : len(word)] = torch.tensor(word)
            lengths[row, i] = len(word)
    return BadWords(words, lengths)


def mask_bad_words(
    queries: torch.Tensor,
    history: torch.Tensor,
    ends: torch.Tensor,
    first_output: torch.Tensor,
    words: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """The device program, vLLM's rule per query: ``queries`` [rows, width,
    vocab]; ``history`` [rows, span] each row's tokens (its drafts after
    them); ``ends`` [rows, width] where each query's past ends; ``first_output``
    [rows] where the row's outputs start (only outputs count, as in vLLM);
    ``words``/``lengths`` as in ``BadWords``. A word's last token is masked
    where the past ends with the rest of the word (a one-token word always)."""
    rows, width, vocab = queries.shape
    span = history.shape[1]
    prefix = lengths - 1  # -1 for a padded word
    starts = ends[:, :, None] - prefix[:, None, :]  # [rows, width, words]
    match = (lengths > 0)[:, None, :] & (starts >= first_output[:, None, None])
    for i in range(words.shape[2] - 1):
        position = (starts + i).clamp(0, span - 1)
        token = history.gather(1, position.reshape(rows, -1)).view_as(position)
        match &= (i >= prefix[:, None, :]) | (token == words[:, None, :, i])
    last = words.gather(2, prefix.clamp(min=0)[..., None])[..., 0]  # [rows, words]
    # A count per token: two words may end in the same token.
    hits = torch.zeros(rows, width, vocab, dtype=torch.int32).scatter_add_(
        2, last[:, None, :].expand(-1, width, -1), match.int()
    )
    return queries.masked_fill(hits > 0, -torch.inf)


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


def penalize_queries(
    queries: torch.Tensor,
    history: torch.Tensor,
    ends: torch.Tensor,
    prompt_lens: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """The device program, vLLM's penalties per query (its
    ``apply_penalties`` does the arithmetic): ``queries`` [rows, width,
    vocab]; ``history``, ``ends`` as in ``mask_bad_words``; the row's prompt
    (``prompt_lens``, read from the history, so no batch-wide padding) counts
    for the repetition penalty, its outputs and the query's drafts for all
    three; the penalties are [rows]. -> a new tensor."""
    rows, width, vocab = queries.shape
    span = history.shape[1]
    position = torch.arange(span)[None, :]
    prompts = torch.where(position < prompt_lens[:, None], history, vocab)
    is_output = (position[:, None, :] >= prompt_lens[:, None, None]) & (
        position[:, None, :] < ends[:, :, None]
    )
    outputs = torch.where(is_output, history[:, None, :], vocab)
    return apply_penalties(
        queries.reshape(rows * width, vocab).clone(),
        prompts.repeat_interleave(width, 0),
        outputs.reshape(rows * width, span),
        presence.repeat_interleave(width),
        frequency.repeat_interleave(width),
        repetition.repeat_interleave(width),
    ).view(rows, width, vocab)
