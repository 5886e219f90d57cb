"""The device programs around the forward trace into one graph per declared
shape (``torch.compile(fullgraph=True, dynamic=False)``: a host read or a
data-dependent shape inside fails the trace), and the graph answers what the
eager program does. Dynamo's eager backend: the trace is what is checked."""

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from vllm_neuron_sched.worker.compiled import (
    CompiledProgram,
    ShapeNotCompiledError,
    compile_programs,
)
from vllm_neuron_sched.worker.history_rules import (
    mask_bad_words,
    penalize_queries,
    plan_bad_words,
)
from vllm_neuron_sched.worker.lm_head import Head
from vllm_neuron_sched.worker.logits_rules import mask_min_tokens
from vllm_neuron_sched.worker.programs import EAGER, PROGRAMS, Dimensions, Program
from vllm_neuron_sched.worker.spec.ngram import propose_ngram_drafts
from vllm_neuron_sched.worker.spec.rejection import (
    REJECTED,
    Randomness,
    accept_drafts,
)
from vllm_neuron_sched.worker.token_table import (
    DeviceTokens,
    PrefixWrites,
    plan_forward_ids,
)

K = 4  # drafts per row
VOCAB = 64
DECODE_BUCKETS = (1, 2, 4, 8)
WIDTHS = (1, 1 + K)  # a verify step without drafts, and with
HISTORY_LEN = 48
BAD_WORDS_SHAPE = (4, 16)  # words, tokens per row
NUM_SLOTS = 9  # the token table's: 8 requests and the spare
TOKEN_COUNTS = (8, 16, 32)  # the forward's


def _graphs_per_shape(
    program: Callable[..., Any], shapes: list[tuple[int, ...]], make: Callable
) -> None:
    """Traces ``program`` at each shape (fullgraph), checks every answer
    against eager, and that each shape compiled once: a second call at every
    shape adds no graph."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(program, fullgraph=True, dynamic=False, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=64):
        for _ in range(2):
            for shape in shapes:
                args = make(*shape)
                torch.testing.assert_close(compiled(*args), program(*args))
    assert counters["stats"]["unique_graphs"] == len(shapes)


def _accept_inputs(
    rows: int, width: int, random: bool, top_k: bool = False
) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(rows * 10 + width)
    queries = torch.randn(rows, width, VOCAB, generator=generator)
    argmax = queries.argmax(dim=-1)
    drafts = torch.randint(0, VOCAB, (rows, K), generator=generator, dtype=torch.int32)
    # Half the drafts the target's argmax, so runs of accepted drafts occur.
    agree = torch.rand(rows, K, generator=generator) < 0.5
    drafts[:, : width - 1] = torch.where(
        agree[:, : width - 1], argmax[:, : width - 1].int(), drafts[:, : width - 1]
    )
    num_drafts = torch.randint(0, width, (rows,), generator=generator)
    randomness = None
    if random:
        temperature = torch.rand(rows, generator=generator) + 0.1
        temperature[0] = 0.0  # a greedy row among random ones
        randomness = Randomness(
            temperature,
            # int32, as vLLM's input batch holds top-k.
            torch.full((rows,), 5, dtype=torch.int32) if top_k else None,
            torch.full((rows,), 0.9) if top_k else None,
            torch.empty(rows, VOCAB).exponential_(generator=generator),
            torch.rand(rows, K, generator=generator),
            torch.empty(rows, VOCAB).exponential_(generator=generator),
        )
    return queries, drafts, num_drafts, randomness


@pytest.mark.parametrize(
    ("random", "top_k"), [(False, False), (True, False), (True, True)]
)
def test_rejection_sampling_is_one_graph_per_decode_bucket_and_width(
    random: bool, top_k: bool
) -> None:
    shapes = [(rows, width) for rows in DECODE_BUCKETS for width in WIDTHS]
    _graphs_per_shape(
        accept_drafts,
        shapes,
        lambda rows, width: _accept_inputs(rows, width, random, top_k),
    )


def test_the_traced_program_keeps_the_greedy_rule() -> None:
    """Fixed shapes, same answer: each greedy row's leading run of drafts
    that are the argmax, then the argmax (after all of them the bonus: the
    argmax of the query that follows them)."""
    queries, drafts, num_drafts, _ = _accept_inputs(8, 1 + K, random=False)
    torch._dynamo.reset()
    out = torch.compile(accept_drafts, fullgraph=True, dynamic=False, backend="eager")(
        queries, drafts, num_drafts, None
    )
    argmax = queries.argmax(dim=-1)
    for row in range(8):
        n, expected = int(num_drafts[row]), []
        for j in range(n):
            expected.append(int(argmax[row, j]))
            if drafts[row, j] != argmax[row, j]:
                break
        else:
            expected.append(int(argmax[row, n]))
        assert out[row].tolist() == expected + [REJECTED] * (1 + K - len(expected))


def test_ngram_proposal_is_one_graph_per_decode_bucket() -> None:
    def make(rows: int) -> tuple[Any, ...]:
        generator = torch.Generator().manual_seed(rows)
        tokens = torch.randint(0, 6, (rows, HISTORY_LEN), generator=generator)
        lengths = torch.randint(1, HISTORY_LEN + 1, (rows,), generator=generator)
        return tokens.int(), lengths, K, 1, 3, 40

    _graphs_per_shape(propose_ngram_drafts, [(rows,) for rows in DECODE_BUCKETS], make)


def _min_tokens_inputs(rows: int, width: int) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(rows * 10 + width)
    queries = torch.randn(rows, width, VOCAB, generator=generator)
    stops = torch.zeros(rows, VOCAB, dtype=torch.bool)
    stops[:, :2] = True
    if rows > 1:
        queries[1, :, 2:] = -torch.inf  # a grammar that leaves only stops
    num_outputs = torch.randint(0, 4, (rows,), generator=generator)
    wanted = torch.randint(0, 6, (rows,), generator=generator)
    structured = torch.arange(rows) % 2 == 1
    return queries, num_outputs, wanted, stops, structured


def test_min_tokens_masks_are_one_graph_per_decode_bucket_and_width() -> None:
    shapes = [(rows, width) for rows in DECODE_BUCKETS for width in WIDTHS]
    _graphs_per_shape(mask_min_tokens, shapes, _min_tokens_inputs)


def test_min_tokens_masks_each_querys_stops_until_the_count_is_reached() -> None:
    queries, num_outputs, wanted, stops, structured = _min_tokens_inputs(8, 1 + K)
    out = mask_min_tokens(queries, num_outputs, wanted, stops, structured)
    for row in range(8):
        for j in range(1 + K):
            masked = num_outputs[row] + j < wanted[row]
            only_stops = bool(torch.isneginf(queries[row, j, 2:]).all())
            if masked and not (structured[row] and only_stops):
                assert torch.isneginf(out[row, j, :2]).all()
            else:
                assert torch.equal(out[row, j], queries[row, j])
            assert torch.equal(out[row, j, 2:], queries[row, j, 2:])


def _bad_words_inputs(rows: int, width: int) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(rows * 10 + width)
    queries = torch.randn(rows, width, VOCAB, generator=generator)
    history = torch.randint(0, 3, (rows, HISTORY_LEN + K), generator=generator)
    lengths = torch.randint(4, HISTORY_LEN, (rows,), generator=generator)
    ends = lengths[:, None] + torch.arange(width)[None, :]
    first_output = torch.randint(1, 4, (rows,), generator=generator)
    # Up to four words of up to four tokens from a small alphabet, so some
    # match; laid out at the declared shape.
    words = {
        row: [
            torch.randint(0, 3, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 5, (int(count),), generator=generator)
        ]
        for row, count in enumerate(torch.randint(0, 5, (rows,), generator=generator))
    }
    planned = plan_bad_words(rows, words, BAD_WORDS_SHAPE)
    return queries, history, ends, first_output, planned


def test_bad_words_masks_are_one_graph_per_decode_bucket_and_width() -> None:
    shapes = [(rows, width) for rows in DECODE_BUCKETS for width in WIDTHS]
    _graphs_per_shape(mask_bad_words, shapes, _bad_words_inputs)


def _penalties_inputs(rows: int, width: int) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(rows * 10 + width)
    queries = torch.randn(rows, width, VOCAB, generator=generator)
    history = torch.randint(0, VOCAB, (rows, HISTORY_LEN + K), generator=generator)
    lengths = torch.randint(4, HISTORY_LEN, (rows,), generator=generator)
    ends = lengths[:, None] + torch.arange(width)[None, :]
    prompt_lens = torch.randint(1, 4, (rows,), generator=generator)
    presence, frequency = torch.rand(2, rows, generator=generator)
    repetition = torch.rand(rows, generator=generator) + 1.0
    return queries, history, ends, prompt_lens, presence, frequency, repetition


def test_penalties_are_one_graph_per_decode_bucket_and_width() -> None:
    shapes = [(rows, width) for rows in DECODE_BUCKETS for width in WIDTHS]
    _graphs_per_shape(penalize_queries, shapes, _penalties_inputs)


# Small engine dimensions: the registry's declared shapes at them.
HIDDEN_SIZE = 8


class _LinearHead(torch.nn.Module):
    """A model's LM head as the ``compute_logits`` program calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(HIDDEN_SIZE, VOCAB, bias=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


DIMS = Dimensions(
    rows=(1, 2, 4),
    num_drafts=K,
    vocab=VOCAB,
    history_len=HISTORY_LEN,
    noise_dtype=torch.float32,
    slots=NUM_SLOTS,
    tokens=TOKEN_COUNTS,
    min_n=1,
    max_n=3,
    max_model_len=40,
    bad_words=BAD_WORDS_SHAPE,
    block_sizes=(16, 32),  # two KV cache groups
    heads=(Head(_LinearHead(), HIDDEN_SIZE, torch.float32),),
)
EAGER_BACKEND = {"fullgraph": True, "dynamic": False, "backend": "eager"}


# A pipeline stage's transfers need a peer: test_stage_programs.py.
STAGE_PROGRAMS = ("share_tokens", "receive_hidden", "send_hidden")


@pytest.mark.parametrize(
    "program",
    [p for p in PROGRAMS if p.name not in STAGE_PROGRAMS],
    ids=lambda p: p.name,
)
def test_every_registered_program_is_one_graph_per_declared_shape(
    program: Program,
) -> None:
    """What a port compiles: each program of the registry at each of its
    declared shapes, traced whole, one graph each."""
    examples = list(program.examples(DIMS))
    assert examples
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(program.function, **EAGER_BACKEND)
    with torch._dynamo.config.patch(recompile_limit=64), torch.inference_mode():
        for _ in range(2):
            for args in examples:
                compiled(*args)
    assert counters["stats"]["unique_graphs"] == len(examples)


def test_compiled_programs_pad_rows_to_a_bucket_and_refuse_other_shapes() -> None:
    """The compiled device's programs: 3 rows run in the 4-row graph and
    answer as the eager program; a shape nobody declared (another vocabulary)
    is an error naming the program, and compiles nothing."""
    torch._dynamo.reset()
    programs = compile_programs(
        DIMS, EAGER_BACKEND, lambda fn, *args: fn(*args), "test: programs"
    )
    program = programs.accept_drafts
    assert isinstance(program, CompiledProgram)
    graphs = program.graphs()
    (declared,) = (p for p in PROGRAMS if p.name == "accept_drafts")
    assert graphs == len(list(declared.examples(DIMS)))
    with torch.inference_mode():
        for random in (False, True):
            args = _accept_inputs(3, 1 + K, random, top_k=random)
            torch.testing.assert_close(program(*args), accept_drafts(*args))
        queries, *rest = _accept_inputs(3, 1 + K, random=False)
        with pytest.raises(ShapeNotCompiledError, match="program accept_drafts"):
            program(torch.cat([queries, queries], dim=-1), *rest)
    assert program.graphs() == graphs
    # The bad words are laid out at the shape their graphs were compiled for.
    assert isinstance(programs.mask_bad_words, CompiledProgram)
    assert programs.bad_words_shape == BAD_WORDS_SHAPE


def test_the_token_tables_compiled_programs_write_what_the_eager_ones_write() -> None:
    """The token table's programs on the compiled device (their rows padded
    to a bucket with copies of the last, which write what it writes) leave
    the table as the eager ones do, and read what they read: a forward of
    prompt and decode tokens and a prefix-cache hit, a step's sampling and
    a verify step's accepted runs, drafts; then a forward that reads the
    tokens back, and the rows' histories and drafts."""
    torch._dynamo.reset()
    compiled = compile_programs(
        DIMS, EAGER_BACKEND, lambda fn, *args: fn(*args), "test: programs"
    )
    tables = {}
    for name, programs in {"eager": EAGER, "compiled": compiled}.items():
        table = DeviceTokens(NUM_SLOTS - 1, HISTORY_LEN, num_drafts=K)
        table.programs = programs
        tables[name] = (table, _run_table(table))
    (eager, eager_ids), (ours, our_ids) = tables.values()
    for got, want in zip(our_ids, eager_ids):
        torch.testing.assert_close(got, want)
    for name in ("_table", "_history", "_lengths", "_drafts", "_draft_counts"):
        torch.testing.assert_close(getattr(ours, name), getattr(eager, name))
    calls = {n: getattr(compiled, n).calls for n in TABLE_PROGRAMS}
    assert calls == {
        "forward_ids": 2,
        "write_prefix": 1,
        "accept_tokens": 2,
        "set_drafts": 1,
        "read_histories": 1,
        "read_drafts": 1,
    }


TABLE_PROGRAMS = (
    "forward_ids",
    "write_prefix",
    "accept_tokens",
    "set_drafts",
    "read_histories",
    "read_drafts",
)


def _run_table(table: DeviceTokens) -> list[torch.Tensor]:
    """Three rows in slots 2, 5, 7: a prompt chunk, a decode, a last chunk
    after a prefix-cache hit of 3; 10 tokens padded to 16."""
    generator = torch.Generator().manual_seed(3)
    slots = np.array([2, 5, 7])
    num_run = np.array([5, 1, 4])
    row_of_token = np.repeat(np.arange(3), num_run)
    plan = plan_forward_ids(
        16,
        np.arange(10),
        row_of_token,
        np.array([False, True, False]),
        np.cumsum(num_run) - 1,
        slots,
    )
    positions = torch.arange(16) % 7
    prefix = PrefixWrites(
        torch.tensor([7]),
        torch.randint(
            0, VOCAB, (1, HISTORY_LEN), generator=generator, dtype=torch.int32
        ),
        torch.tensor([3]),
    )
    rows = torch.from_numpy(slots)
    with torch.inference_mode():
        host_ids = torch.randint(
            0, VOCAB, (16,), generator=generator, dtype=torch.int32
        )
        first = table.forward_ids(host_ids, positions, plan, prefix)
        table.accept_sampled(rows, torch.tensor([5, 9, 7]), torch.tensor([11, 12, 13]))
        runs = torch.randint(0, VOCAB, (3, 1 + K), generator=generator)
        table.accept(rows, torch.tensor([6, 10, 8]), runs, torch.tensor([1, 5, 3]))
        drafts = torch.randint(0, VOCAB, (3, K), generator=generator)
        table.set_drafts(rows, drafts, torch.tensor([0, 4, 2]))
        again = table.forward_ids(host_ids, positions, plan, None)
        reads = [*table.histories_of(rows), *table.drafts_of(rows)]
    return [first, again, *reads]
