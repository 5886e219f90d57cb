"""A plain step's sampling programs (``sampling.sample_rows``, after
``draw_sampling``; the rows' rules first, ``logits_rules.py``, over the
device histories): the tokens and logprobs vLLM's CPU sampler gives, seeded
rows' too, each generator left where vLLM's leaves it; traced into one
graph per variant, answering as eager; and vLLM's sampler where the step
needs more."""

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm_neuron_sched.testing.sampling import sampling_metadata
from vllm_neuron_sched.worker.compiled import CompiledProgram, compile_programs
from vllm_neuron_sched.worker.logits_rules import (
    NO_RULES,
    QueryPasts,
    RowRules,
    plan_rules,
)
from vllm_neuron_sched.worker.programs import EAGER, Dimensions, Programs
from vllm_neuron_sched.worker.sampling import (
    draw_sampling,
    noise_dtype,
    sample_in_program,
    sample_rows,
)

VOCAB = 50
ROWS = 6
TEMPERATURES = [0.0, 0.7, 1.0, 0.0, 1.3, 0.5]  # greedy rows among random ones
SEEDED = (1, 4)
ALL_SAMPLED = np.ones(ROWS, dtype=bool)
LOGPROBS_MODES = [
    "raw_logprobs",
    "processed_logprobs",
    "raw_logits",
    "processed_logits",
]


def _sample(
    sampler: Sampler,
    programs: Programs,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    rules: RowRules = NO_RULES,
    pasts: QueryPasts | None = None,
) -> tuple[torch.Tensor, Any]:
    """A step as an engine without the user's processors samples: the
    host's draws at enqueue, then the programs."""
    noise = noise_dtype(sampler)
    draws = draw_sampling(metadata, ALL_SAMPLED, VOCAB, noise, rules.min_p)
    return sample_in_program(sampler, programs, logits, metadata, draws, rules, pasts)


def _logits(seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Spread out, so that top-k and top-p cut real candidates.
    return torch.randn(ROWS, VOCAB, generator=generator) * 3


def _generators(
    seed: int, rows: tuple[int, ...] = SEEDED
) -> dict[int, torch.Generator]:
    return {row: torch.Generator().manual_seed(seed + row) for row in rows}


def _settings(top_k: bool, top_p: bool) -> dict:
    return {
        "top_k": [5, 50, 3, 10, 50, 7] if top_k else None,
        "top_p": [0.9, 1.0, 0.5, 0.8, 0.95, 1.0] if top_p else None,
    }


@pytest.mark.parametrize("fp64", [False, True], ids=["seeds", "fp64_noise"])
@pytest.mark.parametrize(
    ("top_k", "top_p"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_the_program_samples_as_vllms_sampler(
    top_k: bool, top_p: bool, fp64: bool
) -> None:
    """Several steps in a row: each seeded row's tokens are vLLM's sampler's,
    and its generator moved as vLLM's moved it (so the next step's draw is
    the same too); greedy rows take the argmax."""
    settings = _settings(top_k, top_p)
    ours_generators, vllm_generators = _generators(7), _generators(7)
    sampler = Sampler(use_fp64_gumbel=fp64)
    greedy = [row for row, t in enumerate(TEMPERATURES) if t == 0.0]
    for step in range(3):
        logits = _logits(step)
        ours = sampling_metadata(TEMPERATURES, ours_generators, **settings)
        theirs = sampling_metadata(TEMPERATURES, vllm_generators, **settings)
        tokens, _ = _sample(sampler, EAGER, logits.clone(), ours)
        expected = sampler(logits.clone(), theirs).sampled_token_ids[:, 0]
        assert tokens[list(SEEDED)].tolist() == expected[list(SEEDED)].tolist()
        assert tokens[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
        for row in SEEDED:
            assert torch.equal(
                ours_generators[row].get_state(), vllm_generators[row].get_state()
            )


# What a batch asks of the logprobs: the top 3, the whole vocabulary (vLLM's
# n = -1), given tokens (its generative scoring: they win over the top-n).
ASKED = {
    "top3": {"max_num_logprobs": 3},
    "vocab": {"max_num_logprobs": -1},
    "given": {"max_num_logprobs": 2, "logprob_token_ids": {1: [4, 9], 3: [0]}},
}


@pytest.mark.parametrize("asked", list(ASKED))
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("all_greedy", [True, False], ids=["greedy", "mixed"])
def test_logprobs_are_vllms_in_every_mode(
    mode: str, all_greedy: bool, asked: str
) -> None:
    """The top-n, the sampled token's logprob and rank, the whole
    vocabulary's or given tokens', as vLLM's sampler reports them: the
    processed modes after temperature, top-k and top-p unless every row is
    greedy. Every random row seeded: all tokens equal."""
    sampler = Sampler(logprobs_mode=mode)
    temperatures = [0.0] * ROWS if all_greedy else TEMPERATURES
    random_rows = tuple(row for row, t in enumerate(temperatures) if t > 0)

    def metadata() -> SamplingMetadata:
        generators = _generators(9, random_rows)
        made = sampling_metadata(temperatures, generators, **_settings(True, True))
        return replace(made, **ASKED[asked])

    ours, theirs = metadata(), metadata()
    logits = _logits()
    tokens, logprobs = _sample(sampler, EAGER, logits.clone(), ours)
    expected = sampler(logits.clone(), theirs)
    assert tokens.tolist() == expected.sampled_token_ids[:, 0].tolist()
    assert logprobs is not None and expected.logprobs_tensors is not None
    width = {"top3": 4, "vocab": VOCAB, "given": 3}[asked]
    assert logprobs.logprobs.shape == (ROWS, width)
    for got, want in zip(logprobs, expected.logprobs_tensors, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)


# Each row's prompt and outputs so far (repeats, so that every penalty acts).
PROMPTS = [[1, 2, 3], [4, 4], [5, 6, 7, 5], [8], [9, 10], [11, 12, 11]]
OUTPUTS = [[3, 3, 20], [], [7, 21], [8, 8, 8, 22], [23], [12, 24, 24]]


# Bad words on some rows: one-token, a prefix the outputs end with (row 3:
# its 22 then 30), one whose prefix reaches into the prompt (never masks).
BAD_WORDS = {0: [[41]], 3: [[22, 30], [7, 8, 31]], 5: [[11, 12, 24, 24, 32]]}


def _with_penalties(metadata: SamplingMetadata) -> SamplingMetadata:
    """vLLM's input batch: the prompts padded with the vocabulary size, the
    outputs as lists; a penalty of each kind on different rows, and the bad
    words."""
    width = max(map(len, PROMPTS))
    prompts = [p + [VOCAB] * (width - len(p)) for p in PROMPTS]
    return replace(
        metadata,
        no_penalties=False,
        prompt_token_ids=torch.tensor(prompts),
        presence_penalties=torch.tensor([0.5, 0.0, 0.0, 1.0, 0.0, -0.5]),
        frequency_penalties=torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0, 0.2]),
        repetition_penalties=torch.tensor([1.0, 1.2, 1.5, 1.0, 0.8, 1.3]),
        output_token_ids=[list(o) for o in OUTPUTS],
        bad_words_token_ids=BAD_WORDS,
    )


def _params(per_row: dict[int, dict] | None = None) -> list[SamplingParams]:
    """Each row's parameters: the bad words (tokenized, as the front end
    leaves them), and ``per_row``'s settings by row."""
    params = []
    for row in range(ROWS):
        made = SamplingParams(**(per_row or {}).get(row, {}))
        made._bad_words_token_ids = BAD_WORDS.get(row, [])
        params.append(made)
    return params


HISTORY_WIDTH = 16


def _pasts(width: int = HISTORY_WIDTH) -> QueryPasts:
    """The device histories: prompt then outputs, garbage past them."""
    history = torch.full((ROWS, width), 2, dtype=torch.int64)
    for row, (prompt, outputs) in enumerate(zip(PROMPTS, OUTPUTS)):
        tokens = prompt + outputs
        history[row, : len(tokens)] = torch.tensor(tokens)
    return QueryPasts(
        history,
        torch.tensor([[len(p) + len(o)] for p, o in zip(PROMPTS, OUTPUTS)]),
        torch.tensor([len(p) for p in PROMPTS]),
    )


def _rules(params: list[SamplingParams]) -> RowRules:
    return plan_rules(params, VOCAB, None)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_bad_words_and_penalties_sample_as_vllms_sampler(mode: str) -> None:
    """Bad words, then presence, frequency and repetition penalties, read
    from the device histories (``history_rules.py``, one query per row),
    then the sampling program: vLLM's tokens and logprobs, the raw modes
    from the logits before them, the processed ones after."""
    sampler = Sampler(logprobs_mode=mode)
    random_rows = tuple(row for row, t in enumerate(TEMPERATURES) if t > 0)

    def metadata() -> SamplingMetadata:
        made = sampling_metadata(TEMPERATURES, _generators(13, random_rows))
        return replace(_with_penalties(made), max_num_logprobs=2)

    ours, theirs = metadata(), metadata()
    logits = _logits(4)
    # Row 0 (greedy) would take token 20, which its outputs hold: its
    # presence penalty moves it to the runner-up.
    logits[0, 20] = logits[0].max() + 0.1
    # Row 3 (greedy) would take 30, which its bad word [22, 30] rules out.
    logits[3, 30] = logits[3].max() + 5.0
    tokens, logprobs = _sample(
        sampler, EAGER, logits.clone(), ours, _rules(_params()), _pasts()
    )
    expected = sampler(logits.clone(), theirs)
    assert tokens.tolist() == expected.sampled_token_ids[:, 0].tolist()
    assert tokens[0] != 20 and tokens[3] != 30
    assert logprobs is not None and expected.logprobs_tensors is not None
    for got, want in zip(logprobs, expected.logprobs_tensors, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)


# Row 0 (greedy) would stop (17) before its min_tokens; row 1 is biased
# towards 33, row 2 allowed 5, 6 and 7 only; row 4 has its min_tokens; row 5
# sets min_p.
RULES = {
    0: {"min_tokens": 5, "stop_token_ids": [17]},
    1: {"logit_bias": {33: 40.0, 2: -3.0}},
    2: {"allowed_token_ids": [5, 6, 7]},
    4: {"min_tokens": 1, "stop_token_ids": [9]},
    5: {"min_p": 0.2},
}
MAX_NUM_SEQS = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=ROWS))


def _builtin_processors(params: list[SamplingParams]) -> LogitsProcessors:
    """vLLM's built-in processors, told of the rows."""
    cpu = torch.device("cpu")
    processors = [
        MinTokensLogitsProcessor(None, cpu, False),  # type: ignore[arg-type]
        LogitBiasLogitsProcessor(None, cpu, False),
        MinPLogitsProcessor(MAX_NUM_SEQS, cpu, False),  # type: ignore[arg-type]
    ]
    added = [(row, p, None, list(OUTPUTS[row])) for row, p in enumerate(params)]
    for processor in processors:
        processor.update_state(BatchUpdate(ROWS, [], added, []))
    return LogitsProcessors(processors)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_every_rule_samples_as_vllms_sampler(mode: str) -> None:
    """Allowed tokens, bad words, min_tokens, logit bias, the penalties and
    min_p together, each as the rows' parameters plan it (``plan_rules``),
    then the sampling program: vLLM's tokens and logprobs, which its
    sampler gets from its input batch's mask and its built-in processors."""
    _every_rule_against_vllm(mode, EAGER)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_every_rule_runs_in_the_compiled_programs(mode: str) -> None:
    """The same step on the compiled device's programs (dynamo's eager
    backend): each call at a declared shape and dtype (any other fails with
    ``ShapeNotCompiledError``), 6 rows padded to the bucket of 8; vLLM's
    tokens and logprobs."""
    torch._dynamo.reset()
    dims = Dimensions(
        rows=(1, 2, 4, 8),
        vocab=VOCAB,
        history_len=HISTORY_WIDTH,
        noise_dtype=torch.float32,
        logprobs_mode=mode,
        bad_words=(4, 8),
    )
    options = {"fullgraph": True, "dynamic": False, "backend": "eager"}
    programs = compile_programs(dims, options, lambda fn, *args: fn(*args), "test")
    calls = _every_rule_against_vllm(mode, programs)
    # The raw scores are a program of the raw modes only.
    raw = {"raw_scores": 1} if mode.startswith("raw") else {}
    assert calls == {
        "sample_rows": 1,
        **raw,
        "mask_tokens": 1,
        "mask_bad_words": 1,
        "mask_min_tokens": 1,
        "add_logit_bias": 1,
        "penalize_queries": 1,
        # The token table's: this step's histories are given, not a table's.
        "write_prefix": 0,
        "accept_tokens": 0,
        "read_histories": 0,
    }


def _every_rule_against_vllm(mode: str, programs: Programs) -> dict[str, int]:
    """One step of every rule, ours against vLLM's sampler; the calls each
    compiled program served."""
    sampler = Sampler(logprobs_mode=mode)
    random_rows = tuple(row for row, t in enumerate(TEMPERATURES) if t > 0)
    params = _params(RULES)
    disallowed = torch.zeros(ROWS, VOCAB, dtype=torch.bool)
    disallowed[2] = True
    disallowed[2, RULES[2]["allowed_token_ids"]] = False

    def metadata() -> SamplingMetadata:
        made = sampling_metadata(TEMPERATURES, _generators(17, random_rows))
        return replace(
            _with_penalties(made),
            max_num_logprobs=2,
            allowed_token_ids_mask=disallowed.clone(),
            logitsprocs=_builtin_processors(params),
        )

    ours, theirs = metadata(), metadata()
    logits = _logits(5)
    logits[0, 17] = logits[0].max() + 5.0
    logits[4, 9] = logits[4].max() + 50.0  # row 4 has its one output: may stop
    rules = plan_rules(params, VOCAB, programs.bad_words_shape)
    tokens, logprobs = _sample(sampler, programs, logits.clone(), ours, rules, _pasts())
    expected = sampler(logits.clone(), theirs)
    assert tokens.tolist() == expected.sampled_token_ids[:, 0].tolist()
    assert tokens[0] != 17 and tokens[1] == 33 and tokens[2] in (5, 6, 7)
    assert tokens[4] == 9
    assert logprobs is not None and expected.logprobs_tensors is not None
    for got, want in zip(logprobs, expected.logprobs_tensors, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)
    return {
        name: program.calls
        for name, program in vars(programs).items()
        if isinstance(program, CompiledProgram)
    }


# Rows' min_p (0: none), on greedy rows too: vLLM's processed scores see it.
MIN_P = [0.3, 0.99, 0.0, 0.2, 0.5, 0.1]


@pytest.mark.parametrize("fp64", [False, True], ids=["seeds", "fp64_noise"])
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_min_p_samples_as_vllms_sampler(mode: str, fp64: bool) -> None:
    """Every random row seeded, with top-k and top-p: min_p after the
    temperature and before them, as vLLM's built-in processor applies it,
    gives vLLM's tokens and logprobs; a row whose min_p cuts its draw's
    candidates to one takes that one (row 1: all but one of its tokens
    within 5% of the best, which a draw without min_p would take at 1 in
    50)."""
    cpu = torch.device("cpu")
    params = [SamplingParams(min_p=value) for value in MIN_P]
    random_rows = tuple(row for row, t in enumerate(TEMPERATURES) if t > 0)
    sampler = Sampler(logprobs_mode=mode, use_fp64_gumbel=fp64)

    def metadata() -> SamplingMetadata:
        min_p = MinPLogitsProcessor(MAX_NUM_SEQS, cpu, False)  # type: ignore[arg-type]
        added = [(row, p, None, []) for row, p in enumerate(params)]
        min_p.update_state(BatchUpdate(ROWS, [], added, []))
        made = sampling_metadata(
            TEMPERATURES, _generators(21, random_rows), **_settings(True, True)
        )
        return replace(made, max_num_logprobs=2, logitsprocs=LogitsProcessors([min_p]))

    ours, theirs = metadata(), metadata()
    logits = _logits(6)
    logits[1] = 0.0
    logits[1, 7] = 0.05
    logits[4, 11] = logits[4].max() + 3.0  # min_p 0.5 at temperature 1.3
    tokens, logprobs = _sample(sampler, EAGER, logits.clone(), ours, _rules(params))
    expected = sampler(logits.clone(), theirs)
    assert tokens.tolist() == expected.sampled_token_ids[:, 0].tolist()
    assert tokens[1] == 7 and tokens[4] == 11
    assert logprobs is not None and expected.logprobs_tensors is not None
    for got, want in zip(logprobs, expected.logprobs_tensors, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)


def test_a_row_that_samples_nothing_draws_nothing() -> None:
    """A prompt chunk that is not the last: its generator stays, so the seed
    gives the same tokens however the prompt is chunked."""
    generators = _generators(11)
    before = generators[SEEDED[0]].get_state()
    is_sampled = ALL_SAMPLED.copy()
    is_sampled[SEEDED[0]] = False
    draw_sampling(
        sampling_metadata(TEMPERATURES, generators), is_sampled, VOCAB, torch.float32
    )
    assert torch.equal(generators[SEEDED[0]].get_state(), before)
    moved = generators[SEEDED[1]].get_state()
    assert not torch.equal(moved, _generators(11)[SEEDED[1]].get_state())


def test_greedy_steps_draw_nothing() -> None:
    metadata = sampling_metadata([0.0] * ROWS)
    assert draw_sampling(metadata, ALL_SAMPLED, VOCAB, torch.float32) is None


@pytest.mark.parametrize("fp64", [False, True], ids=["seeds", "fp64_noise"])
def test_the_traced_program_answers_as_eager(fp64: bool) -> None:
    """fullgraph (vLLM's kernels traced through their fake shapes), the same
    tokens and scores as the eager program."""
    torch._dynamo.reset()
    compiled = torch.compile(
        sample_rows, fullgraph=True, dynamic=False, backend="eager"
    )
    noise = torch.float64 if fp64 else torch.float32
    for top_k, top_p in [(False, False), (True, True)]:
        settings = _settings(top_k, top_p)
        metadata = sampling_metadata(TEMPERATURES, _generators(5), **settings)
        draws = draw_sampling(metadata, ALL_SAMPLED, VOCAB, noise)
        logits = _logits()
        for mode in (None, "processed_logprobs"):
            got, want = compiled(logits, draws, mode), sample_rows(logits, draws, mode)
            torch.testing.assert_close(got, want)
