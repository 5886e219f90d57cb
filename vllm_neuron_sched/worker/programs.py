"""The device programs around the forward, in one registry: what a port
compiles besides the model, and at which shapes (docs/design.md, section 9).

Each program is a fixed-signature function of tensors whose first dimension
is the step's rows: no host read, no shape that depends on the data. Its
declared shapes are the decode buckets times what the engine fixes at start-up
(the widths 1 and, with speculation, 1 + K, the vocabulary, the logprobs
mode, the token table's width, the sampling variants). ``examples`` gives
one call's arguments per declared shape: the ``compiled`` device
compiles each program with them at start-up (``worker/compiled.py``), and
``tests/v1/worker/test_traced_programs.py`` traces them.
"""

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.utils.math_utils import cdiv

from vllm_neuron_sched.worker.history_rules import (
    BadWords,
    mask_bad_words,
    penalize_queries,
)
from vllm_neuron_sched.worker.layout import rectangle_queries
from vllm_neuron_sched.worker.lm_head import Head, compute_logits
from vllm_neuron_sched.worker.logits_rules import (
    add_logit_bias,
    mask_min_tokens,
    mask_tokens,
)
from vllm_neuron_sched.worker.pipeline import (
    PipelineStage,
    empty_hidden,
    receive_hidden,
    send_hidden,
    share_tokens,
)
from vllm_neuron_sched.worker.sampling import Draws, raw_scores, sample_rows
from vllm_neuron_sched.worker.spec.ngram import propose_ngram_drafts
from vllm_neuron_sched.worker.spec.rejection import Randomness, accept_drafts
from vllm_neuron_sched.worker.token_table import (
    accept_tokens,
    forward_ids,
    read_drafts,
    read_histories,
    set_drafts,
    write_prefix,
)


@dataclass(frozen=True)
class StageShapes:
    """A pipeline stage's place, and what crosses to the next: each
    intermediate tensor's shape past the tokens, and its dtype."""

    group_name: str  # the pipeline group's (``PipelineStage.name``)
    is_first: bool
    is_last: bool
    hidden: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, stage: PipelineStage, model: Any) -> "StageShapes":
        """The stage's, with ``model``'s intermediate tensors (each distinct
        shape and dtype once: one graph serves them all)."""
        tensors = empty_hidden(model, 1).tensors
        hidden = dict.fromkeys(
            (tuple(tensor.shape[1:]), tensor.dtype)
            for _, tensor in sorted(tensors.items())
        )
        return cls(stage.name, stage.is_first, stage.is_last, tuple(hidden))


@dataclass(frozen=True)
class Dimensions:
    """What the declared shapes are made of, fixed at start-up."""

    rows: tuple[int, ...]  # the decode buckets
    vocab: int
    history_len: int  # the token table's width
    noise_dtype: torch.dtype  # the sampler's Gumbel noise (fp64 or fp32)
    slots: int = 1  # the token table's entries (the spare one included)
    tokens: tuple[int, ...] = ()  # the forward's token counts
    logprobs_mode: str = "raw_logprobs"  # vLLM's, the engine's
    num_drafts: int = 0  # K; 0: no speculative decoding
    min_n: int = 0  # the n-gram proposer's; 0: none
    max_n: int = 0
    max_model_len: int = 1
    # The bad words per row, (words, tokens): vLLM's limits per request.
    bad_words: tuple[int, int] = (1, 1)
    block_sizes: tuple[int, ...] = ()  # the KV cache groups'
    stage: StageShapes | None = None  # None: no pipeline stages
    # The models whose LM head steps run (none on a stage before the last).
    heads: tuple[Head, ...] = ()

    @property
    def widths(self) -> tuple[int, ...]:
        """Queries per row: 1 in a plain step's sampling, and with
        speculation 1 + K in a verify step whose rows have drafts."""
        return (1, 1 + self.num_drafts) if self.num_drafts else (1,)

    @property
    def queries(self) -> tuple[int, ...]:
        """A step's query counts: its rows times each width."""
        return tuple(sorted({rows * w for rows in self.rows for w in self.widths}))


Examples = Callable[[Dimensions], Iterator[tuple[Any, ...]]]


@dataclass(frozen=True)
class Program:
    name: str
    function: Callable[..., Any]
    examples: Examples
    # Its first ``state`` arguments are the device's own tensors (the token
    # table's), written in place: never padded.
    state: int = 0
    # What its other arguments' first dimension is: the step's rows (padded
    # to a decode bucket), its queries (a decode bucket times a width), or
    # the forward's tokens (a declared token count).
    along: str = "rows"

    def sizes(self, dims: "Dimensions") -> tuple[int, ...]:
        return {"tokens": dims.tokens, "queries": dims.queries}.get(
            self.along, dims.rows
        )


def _verify_shapes(dims: Dimensions) -> Iterator[tuple[int, int]]:
    """None without speculative decoding (no verify step)."""
    if not dims.num_drafts:
        return
    for rows in dims.rows:
        for width in dims.widths:
            yield rows, width


def _queries(rows: int, width: int, dims: Dimensions) -> torch.Tensor:
    return torch.zeros(rows, width, dims.vocab)


def _history(rows: int, width: int, dims: Dimensions) -> torch.Tensor:
    """A row's tokens then its drafts (``constraints._histories_with_drafts``)."""
    return torch.zeros(rows, dims.history_len + width - 1, dtype=torch.int64)


def _rows_of(rows: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(rows, dtype=dtype)


def _sample_rows_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """Greedy, then random with top-k and top-p each set or not (as vLLM's
    batch has them: None when no row uses one, which keeps stock's tokens
    exact), drawing seeds or fp64 noise as the sampler is configured; each
    with logprobs' scores or without. The logits in float32, as vLLM's
    sampler takes them whatever the model's dtype."""
    fp64 = dims.noise_dtype == torch.float64
    for rows in dims.rows:
        logits = torch.zeros(rows, dims.vocab)
        variants: list[Draws | None] = [None]
        for top_k in (None, torch.full((rows,), dims.vocab, dtype=torch.int32)):
            for top_p in (None, torch.ones(rows)):
                variants.append(
                    Draws(
                        _rows_of(rows, torch.float32),
                        top_k,
                        top_p,
                        None if fp64 else _rows_of(rows),
                        torch.ones(rows, dims.vocab, dtype=dims.noise_dtype)
                        if fp64
                        else None,
                        _rows_of(rows, torch.float32),
                    )
                )
        for draws in variants:
            for scores_mode in (None, dims.logprobs_mode):
                yield logits, draws, scores_mode


def _raw_scores_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """None unless the engine's logprobs mode is a raw one."""
    if not dims.logprobs_mode.startswith("raw"):
        return
    for rows in dims.rows:
        yield torch.zeros(rows, dims.vocab), dims.logprobs_mode


def _accept_drafts_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """Greedy, random, and random with top-k and top-p (``draw_randomness``
    gives both or neither)."""
    for rows, width in _verify_shapes(dims):
        drafts = torch.zeros(rows, dims.num_drafts, dtype=torch.int32)
        common = (_queries(rows, width, dims), drafts, _rows_of(rows))
        for truncated in (None, False, True):
            random = None
            if truncated is not None:
                noise = torch.ones(rows, dims.vocab, dtype=dims.noise_dtype)
                # Valid settings: every token kept (top-k the vocabulary).
                random = Randomness(
                    _rows_of(rows, torch.float32),
                    torch.full((rows,), dims.vocab, dtype=torch.int32)
                    if truncated
                    else None,
                    torch.ones(rows) if truncated else None,
                    noise,
                    torch.zeros(rows, dims.num_drafts),
                    noise,
                )
            yield (*common, random)


def _ngram_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """None without an n-gram proposer (``max_n`` 0)."""
    if not dims.max_n:
        return
    for rows in dims.rows:
        yield (
            torch.zeros(rows, dims.history_len, dtype=torch.int32),
            _rows_of(rows),
            dims.num_drafts,
            dims.min_n,
            dims.max_n,
            dims.max_model_len,
        )


def _per_query(dims: Dimensions) -> Iterator[tuple[int, int]]:
    """A plain step's sampling (width 1) and a verify step's."""
    return itertools.product(dims.rows, dims.widths)


def _mask_tokens_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    for rows, width in _per_query(dims):
        masked = torch.zeros(rows, dims.vocab, dtype=torch.bool)
        yield _queries(rows, width, dims), masked


def _logit_bias_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    for rows, width in _per_query(dims):
        yield _queries(rows, width, dims), torch.zeros(rows, dims.vocab)


def _min_tokens_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    for rows, width in _per_query(dims):
        yield (
            _queries(rows, width, dims),
            _rows_of(rows),
            _rows_of(rows),
            torch.zeros(rows, dims.vocab, dtype=torch.bool),
            _rows_of(rows, torch.bool),
        )


def _penalties_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    for rows, width in _per_query(dims):
        penalty = _rows_of(rows, torch.float32)
        yield (
            _queries(rows, width, dims),
            _history(rows, width, dims),
            torch.zeros(rows, width, dtype=torch.int64),
            _rows_of(rows),
            penalty,
            penalty,
            penalty + 1.0,
        )


def _bad_words_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """The words at the declared shape (``plan_bad_words`` lays a step's out
    there)."""
    num_words, num_tokens = dims.bad_words
    for rows, width in _per_query(dims):
        flat = torch.zeros(rows, num_tokens, dtype=torch.int64)
        yield (
            _queries(rows, width, dims),
            _history(rows, width, dims),
            torch.zeros(rows, width, dtype=torch.int64),
            _rows_of(rows),
            BadWords(
                flat,
                flat,
                flat,
                torch.zeros(rows, num_words, dtype=torch.int64),
                torch.zeros(rows, num_words, dtype=torch.bool),
            ),
        )


def _rectangle_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """A verify step's queries and a draft model's proposal forwards, at
    each width and block size: none without speculative decoding. The
    block tables reach the token table's width (every position a token can
    take), the sequences' bound."""
    if not dims.num_drafts:
        return
    for rows, width in _per_query(dims):
        for block_size in dims.block_sizes:
            columns = cdiv(dims.history_len, block_size)
            table = torch.zeros(rows, columns, dtype=torch.int32)
            yield _rows_of(rows), _rows_of(rows), table, width, block_size


def _table(dims: Dimensions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token table's tensors as ``DeviceTokens`` makes them (not
    inference tensors): its newest tokens, its histories and their lengths."""
    with torch.inference_mode(False):
        return (
            torch.zeros(dims.slots, dtype=torch.int32),
            torch.zeros(dims.slots, dims.history_len, dtype=torch.int32),
            torch.zeros(dims.slots, dtype=torch.int64),
        )


def _forward_ids_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    table, history, _ = _table(dims)
    for tokens in dims.tokens:
        ids = torch.zeros(tokens, dtype=torch.int32)
        yield table, history, ids, _rows_of(tokens), _rows_of(tokens), _rows_of(tokens)


def _write_prefix_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    _, history, _ = _table(dims)
    for rows in dims.rows:
        ids = torch.zeros(rows, dims.history_len, dtype=torch.int32)
        yield history, _rows_of(rows), ids, _rows_of(rows)


def _accept_tokens_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    for rows, width in _per_query(dims):
        tokens = torch.zeros(rows, width, dtype=torch.int32)
        yield *_table(dims), _rows_of(rows), _rows_of(rows), tokens, _rows_of(rows)


def _drafts(dims: Dimensions) -> tuple[torch.Tensor, torch.Tensor]:
    """The token table's drafts and their counts, as ``_table``."""
    with torch.inference_mode(False):
        return (
            torch.zeros(dims.slots, dims.num_drafts, dtype=torch.int32),
            torch.zeros(dims.slots, dtype=torch.int64),
        )


def _set_drafts_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """None without speculative decoding (no drafts)."""
    if not dims.num_drafts:
        return
    for rows in dims.rows:
        new = torch.zeros(rows, dims.num_drafts, dtype=torch.int32)
        yield *_drafts(dims), _rows_of(rows), new, _rows_of(rows)


def _read_histories_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    _, history, lengths = _table(dims)
    for rows in dims.rows:
        yield history, lengths, _rows_of(rows)


def _read_drafts_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """None without speculative decoding (no drafts)."""
    if not dims.num_drafts:
        return
    table, _, lengths = _table(dims)
    for rows in dims.rows:
        yield table, lengths, *_drafts(dims), _rows_of(rows)


def _stage_hidden_examples(
    dims: Dimensions, is_sent: bool
) -> Iterator[tuple[Any, ...]]:
    """At each token count the forward declares: a stage after the first
    receives, one before the last sends."""
    stage = dims.stage
    if stage is None or (stage.is_last if is_sent else stage.is_first):
        return
    for tokens in dims.tokens:
        for shape, dtype in stage.hidden:
            yield torch.zeros(tokens, *shape, dtype=dtype), stage.group_name


def _receive_hidden_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    return _stage_hidden_examples(dims, is_sent=False)


def _send_hidden_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    return _stage_hidden_examples(dims, is_sent=True)


def _lm_head_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """Each head at every query count: a plain step's rows, a verify step's
    rows times its width (a draft model's head runs at rows, but a call
    takes the smallest declared count that holds it, whichever width made
    it)."""
    for head in dims.heads:
        for queries in dims.queries:
            yield torch.zeros(queries, head.hidden_size, dtype=head.dtype), head.model


def _share_tokens_examples(dims: Dimensions) -> Iterator[tuple[Any, ...]]:
    """Every stage, at the decode buckets: a step's sampled tokens."""
    if dims.stage is None:
        return
    for rows in dims.rows:
        yield _rows_of(rows, torch.int32), dims.stage.group_name


PROGRAMS: tuple[Program, ...] = (
    Program("compute_logits", compute_logits, _lm_head_examples, 0, "queries"),
    Program("sample_rows", sample_rows, _sample_rows_examples),
    Program("raw_scores", raw_scores, _raw_scores_examples),
    Program("accept_drafts", accept_drafts, _accept_drafts_examples),
    Program("propose_ngram_drafts", propose_ngram_drafts, _ngram_examples),
    Program("mask_tokens", mask_tokens, _mask_tokens_examples),
    Program("mask_bad_words", mask_bad_words, _bad_words_examples),
    Program("mask_min_tokens", mask_min_tokens, _min_tokens_examples),
    Program("add_logit_bias", add_logit_bias, _logit_bias_examples),
    Program("penalize_queries", penalize_queries, _penalties_examples),
    Program("rectangle_queries", rectangle_queries, _rectangle_examples),
    Program("forward_ids", forward_ids, _forward_ids_examples, 2, "tokens"),
    Program("write_prefix", write_prefix, _write_prefix_examples, 1),
    Program("accept_tokens", accept_tokens, _accept_tokens_examples, 3),
    Program("set_drafts", set_drafts, _set_drafts_examples, 2),
    Program("read_histories", read_histories, _read_histories_examples, 2),
    Program("read_drafts", read_drafts, _read_drafts_examples, 4),
    # The transfers last, and in this order on every stage, so that the
    # compiled device's warm-up pairs them up across ranks: the broadcast
    # (every stage), then each stage's receives before its sends.
    Program("share_tokens", share_tokens, _share_tokens_examples),
    Program("receive_hidden", receive_hidden, _receive_hidden_examples, 0, "tokens"),
    Program("send_hidden", send_hidden, _send_hidden_examples, 0, "tokens"),
)


@dataclass(frozen=True)
class Programs:
    """The programs a step runs, by name: the functions themselves (eager),
    or each compiled per declared shape (``compiled.compile_programs``); and
    the shape a step lays its bad words out at (None: powers of two)."""

    compute_logits: Callable[..., Any] = compute_logits
    sample_rows: Callable[..., Any] = sample_rows
    raw_scores: Callable[..., Any] = raw_scores
    accept_drafts: Callable[..., Any] = accept_drafts
    propose_ngram_drafts: Callable[..., Any] = propose_ngram_drafts
    mask_tokens: Callable[..., Any] = mask_tokens
    mask_bad_words: Callable[..., Any] = mask_bad_words
    mask_min_tokens: Callable[..., Any] = mask_min_tokens
    add_logit_bias: Callable[..., Any] = add_logit_bias
    penalize_queries: Callable[..., Any] = penalize_queries
    rectangle_queries: Callable[..., Any] = rectangle_queries
    forward_ids: Callable[..., Any] = forward_ids
    write_prefix: Callable[..., Any] = write_prefix
    accept_tokens: Callable[..., Any] = accept_tokens
    set_drafts: Callable[..., Any] = set_drafts
    read_histories: Callable[..., Any] = read_histories
    read_drafts: Callable[..., Any] = read_drafts
    share_tokens: Callable[..., Any] = share_tokens
    receive_hidden: Callable[..., Any] = receive_hidden
    send_hidden: Callable[..., Any] = send_hidden
    bad_words_shape: tuple[int, int] | None = None


EAGER = Programs()
