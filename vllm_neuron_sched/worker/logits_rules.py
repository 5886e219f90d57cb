"""What vLLM's sampler applies to each request's logits before it samples,
in its order, at any number of queries per row (``[rows, width, vocab]``: a
plain step's one, a verify step's ``1 + K``): the allowed tokens, the bad
words, ``min_tokens``, the logit bias, then the penalties.

The host plans each row's settings into tensors when it builds the step
(``plan_rules``: no per-request Python runs in an execution; ``min_p`` too,
which vLLM applies while sampling and ``sample_rows`` does); the device
applies them with the registered programs (``constrain_queries``), reading
each query's past from the device histories (``history_rules.py``), never
the host's lists, which under async scheduling still end in placeholders.
The allowed tokens are vLLM's input batch's own mask, and the penalties'
settings its sampling metadata's tensors.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_neuron_sched.worker.history_rules import BadWords, plan_bad_words

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.programs import Programs


@dataclass(frozen=True)
class MinTokens:
    """The rows' ``min_tokens`` (0: none), their stop tokens and whether each
    has a grammar (``mask_min_tokens``)."""

    wanted: torch.Tensor  # [rows] int64
    stops: torch.Tensor  # [rows, vocab] bool
    structured: torch.Tensor  # [rows] bool


@dataclass(frozen=True, eq=False)
class RowRules:
    """What the host plans of a step's rows' rules; None where no row has
    the rule."""

    bad_words: BadWords | None = None
    min_tokens: MinTokens | None = None
    logit_bias: torch.Tensor | None = None  # [rows, vocab] float32
    # [rows] float32 (0: none). vLLM applies it while sampling, after the
    # temperature: ``sample_rows`` does (its draws carry it).
    min_p: torch.Tensor | None = None


NO_RULES = RowRules()


def plan_rules(
    params: Sequence["SamplingParams | None"],
    vocab: int,
    bad_words_shape: tuple[int, int] | None,
) -> RowRules:
    """Host side, at build: ``params`` the rows' sampling parameters (None: a
    row without any, such as a pooling request's); the bad words at
    ``bad_words_shape`` (``plan_bad_words``). Rows that set nothing cost a
    look at their parameters."""
    bad_words: dict[int, list[list[int]]] = {}
    min_tokens: list[tuple[int, SamplingParams]] = []
    biases: list[tuple[int, dict[int, float]]] = []
    min_p: dict[int, float] = {}
    for row, row_params in enumerate(params):
        if row_params is None:
            continue
        if row_params.bad_words_token_ids:
            bad_words[row] = row_params.bad_words_token_ids
        if row_params.min_tokens:
            min_tokens.append((row, row_params))
        if row_params.logit_bias:
            biases.append((row, row_params.logit_bias))
        if row_params.min_p:
            min_p[row] = row_params.min_p
    if not (bad_words or min_tokens or biases or min_p):
        return NO_RULES
    num_rows = len(params)
    return RowRules(
        plan_bad_words(num_rows, bad_words, bad_words_shape),
        _plan_min_tokens(num_rows, min_tokens, vocab) if min_tokens else None,
        _plan_logit_bias(num_rows, biases, vocab) if biases else None,
        _per_row(num_rows, min_p) if min_p else None,
    )


def _per_row(num_rows: int, values: dict[int, float]) -> torch.Tensor:
    per_row = torch.zeros(num_rows, dtype=torch.float32)
    per_row[list(values)] = torch.tensor(list(values.values()))
    return per_row


def _plan_min_tokens(
    num_rows: int, rows: list[tuple[int, "SamplingParams"]], vocab: int
) -> MinTokens:
    wanted = torch.zeros(num_rows, dtype=torch.int64)
    stops = torch.zeros(num_rows, vocab, dtype=torch.bool)
    structured = torch.zeros(num_rows, dtype=torch.bool)
    for row, params in rows:
        wanted[row] = params.min_tokens
        stops[row, list(params.all_stop_token_ids)] = True
        structured[row] = params.structured_outputs is not None
    return MinTokens(wanted, stops, structured)


def _plan_logit_bias(
    num_rows: int, rows: list[tuple[int, dict[int, float]]], vocab: int
) -> torch.Tensor:
    bias = torch.zeros(num_rows, vocab, dtype=torch.float32)
    for row, by_token in rows:
        bias[row, list(by_token)] = torch.tensor(list(by_token.values()))
    return bias


@dataclass(frozen=True)
class QueryPasts:
    """Where each query's past is: ``history[row, :ends[row, j]]`` (a plain
    step's row ends before the token it samples; a verify step's query j
    after j drafts), the first ``prompt_lens`` of it the prompt."""

    history: torch.Tensor | None  # [rows, span] int64; None: no rule reads it
    ends: torch.Tensor  # [rows, width] int64
    prompt_lens: torch.Tensor  # [rows] int64


def reads_history(rules: RowRules, metadata: "SamplingMetadata") -> bool:
    """Whether the rules read the rows' histories (bad words, penalties)."""
    return rules.bad_words is not None or not metadata.no_penalties


def any_rule(rules: RowRules, metadata: "SamplingMetadata") -> bool:
    return (
        rules.min_tokens is not None
        or rules.logit_bias is not None
        or metadata.allowed_token_ids_mask is not None
        or reads_history(rules, metadata)
    )


def constrain_queries(
    programs: "Programs",
    queries: torch.Tensor,
    rules: RowRules,
    metadata: "SamplingMetadata",
    pasts: QueryPasts,
) -> torch.Tensor:
    """Device side: ``queries`` [rows, width, vocab] float32 under each rule
    a row has, in vLLM's order, each a program. -> a new tensor where any
    rule acts (``queries`` itself where none does)."""
    rows = queries.shape[0]
    mask = metadata.allowed_token_ids_mask
    if mask is not None:
        queries = programs.mask_tokens(queries, mask[:rows])
    if rules.bad_words is not None:
        assert pasts.history is not None
        queries = programs.mask_bad_words(
            queries, pasts.history, pasts.ends, pasts.prompt_lens, rules.bad_words
        )
    # After the allowed tokens and the bad words: whether a structured query
    # has a token left is decided over all of them (vLLM's min_tokens
    # processor runs after both).
    if rules.min_tokens is not None:
        min_tokens = rules.min_tokens
        queries = programs.mask_min_tokens(
            queries,
            pasts.ends[:, 0] - pasts.prompt_lens,
            min_tokens.wanted,
            min_tokens.stops,
            min_tokens.structured,
        )
    if rules.logit_bias is not None:
        queries = programs.add_logit_bias(queries, rules.logit_bias)
    if not metadata.no_penalties:
        assert pasts.history is not None
        assert metadata.presence_penalties is not None
        assert metadata.frequency_penalties is not None
        assert metadata.repetition_penalties is not None
        queries = programs.penalize_queries(
            queries,
            pasts.history,
            pasts.ends,
            pasts.prompt_lens,
            metadata.presence_penalties[:rows],
            metadata.frequency_penalties[:rows],
            metadata.repetition_penalties[:rows],
        )
    return queries


def mask_tokens(queries: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """The device program for the allowed tokens: ``masked`` [rows, vocab]
    True where a row may not take the token (vLLM's input batch's mask),
    at every query of the row."""
    return queries.masked_fill(masked[:, None, :], -torch.inf)


def add_logit_bias(queries: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The device program for the logit bias: ``bias`` [rows, vocab] float32,
    0 where a row sets none (adding 0 leaves a logit as it is)."""
    return queries + bias[:, None, :]


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
