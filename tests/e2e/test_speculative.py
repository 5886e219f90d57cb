"""Speculative decoding (the n-gram proposer on the device) through
``LLM.generate``, sync at TP=2 and async at TP=4, against stock vLLM CPU.

The trained repeat checkpoint (``testing/checkpoint.py``) continues a token
cycle greedily, so the drafts of a repeat prompt are accepted in long runs; a
misleading prompt (a pattern the model does not follow, then its start again)
gets its first drafts rejected. Greedy tokens must equal stock vLLM CPU's
*without* speculation, stop tokens inside an accepted run included; in sync
mode vLLM's acceptance counters must equal stock's with its own (sync) n-gram
speculation; in async mode the verify steps take their inputs from the
device (no host wait, no fallback, on every rank) and the ranks finish with
the same tokens. Structured outputs: tokens equal stock's without
speculation too.
"""

import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.checkpoint import (
    ensure_trained_checkpoints,
    repeat_prompt_ids,
    successor_map,
)
from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    counted_since,
    generate,
    spec_decode_counters,
    start_in_subprocess,
)
from vllm_neuron_sched.testing.workloads import (
    PREFIX_HIT_LENGTHS,
    SMALL_ENGINE,
    STOCK_ENV,
)

pytestmark = pytest.mark.slow

ENGINE = {**SMALL_ENGINE, "disable_log_stats": False}
K = 3
TP = 4
NGRAM = {"num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Budgets that are no multiple of 1 + K, so a run ends inside a verify step.
MAX_TOKENS = [26, 17, 30, 11]


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(ensure_trained_checkpoints()[0])


def _misleading_prompt(checkpoint: str, seed: int) -> list[int]:
    """``a b x y z`` twice, then ``a b``: the drafts say ``x y z``, the model
    (whose successor of ``b`` is not ``x``) says otherwise."""
    succ = successor_map(checkpoint)
    a, b = repeat_prompt_ids(checkpoint, seed, length=2)
    rng = random.Random(seed)
    others = [t for t in succ if t not in (succ[b], a, b)]
    pattern = [a, b, *rng.sample(others, 3)]
    return pattern * 2 + [a, b]


def _prompts(checkpoint: str) -> list[list[int]]:
    return [
        repeat_prompt_ids(checkpoint, 1, length=12),
        # Several prefill chunks (the chunk is 32 tokens).
        repeat_prompt_ids(checkpoint, 2, length=40, noise=3),
        _misleading_prompt(checkpoint, 3),
        _misleading_prompt(checkpoint, 4),
    ]


def _params(checkpoint: str) -> list[dict[str, Any]]:
    params = [
        {"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in MAX_TOKENS
    ]
    # A stop token the model reaches inside an accepted run of drafts.
    params[0]["stop_token_ids"] = [_walk(checkpoint)[STOP_AT - 1]]
    # Logprobs of accepted runs and of rejections' replacements.
    params[1]["logprobs"] = params[2]["logprobs"] = 2
    return params


# The stop token is the first request's third output: the middle of the
# first verify step, whose drafts are all accepted.
STOP_AT = 3


def _walk(checkpoint: str, request: int = 0) -> list[int]:
    """A request's greedy continuation, from the successor map."""
    succ = successor_map(checkpoint)
    tokens = [_prompts(checkpoint)[request][-1]]
    for _ in range(MAX_TOKENS[request]):
        tokens.append(succ[tokens[-1]])
    return tokens[1:]


def _stock(checkpoint: str, speculative: bool) -> Any:
    engine = dict(ENGINE)
    if speculative:
        engine["speculative_config"] = {"method": "ngram", **NGRAM}
    return start_in_subprocess(
        checkpoint, _prompts(checkpoint), _params(checkpoint), engine, env=STOCK_ENV
    )


def _structured(checkpoint: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Two requests on the first prompt, whose drafts the model accepts: a
    choice of the walk's first 10 tokens (every draft past them breaks the
    grammar, which then only takes EOS), and a regex that forbids the walk's
    seventh token (its draft is invalid there) and lets the walk resume."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    walk = _walk(checkpoint)
    choice = tokenizer.decode(walk[:10])
    regex = re.escape(tokenizer.decode(walk[:6])) + r" [a-z]+( [a-z]+)*"
    prompt = _prompts(checkpoint)[0]
    params = [
        {"max_tokens": 16, "structured_outputs": {"choice": [choice]}},
        {"max_tokens": 24, "structured_outputs": {"regex": regex}},
    ]
    params = [{"temperature": 0.0, **p} for p in params]
    return [prompt, prompt], params


def _stock_structured(checkpoint: str) -> Any:
    """Stock vLLM CPU without speculation."""
    return start_in_subprocess(
        checkpoint, *_structured(checkpoint), ENGINE, env=STOCK_ENV
    )


def _prefix_prompts(checkpoint: str) -> list[list[int]]:
    """Repeat prompts of ``PREFIX_HIT_LENGTHS`` (run again, each hits the
    prefix cache for all but its last token, a remainder vLLM pads with
    placeholder drafts) and one whose hit leaves six tokens: the n-gram
    proposer must see the tokens the hit covers."""
    lengths = [*PREFIX_HIT_LENGTHS, 70]
    return [repeat_prompt_ids(checkpoint, 5 + i, n) for i, n in enumerate(lengths)]


PREFIX_PARAMS = {"temperature": 0.0, "max_tokens": 18, "ignore_eos": True}


def _stock_prefix(checkpoint: str) -> Any:
    """Stock vLLM CPU with its own n-gram speculation, the prompts twice on
    one engine (the second round hits the prefix cache)."""
    engine = {**ENGINE, "speculative_config": {"method": "ngram", **NGRAM}}
    return start_in_subprocess(
        checkpoint,
        _prefix_prompts(checkpoint),
        PREFIX_PARAMS,
        engine,
        env=STOCK_ENV,
        rounds=2,
    )


@pytest.fixture(scope="module", autouse=True)
def stock_runs(checkpoint: str) -> None:
    """The stock children start with the module, while our engines start."""
    _stock(checkpoint, speculative=True)
    _stock_structured(checkpoint)
    _stock_prefix(checkpoint)


# name -> (engine keywords, environment of its workers)
ENGINES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # Two TP ranks, each with a device thread beside the worker's main
    # thread: the verify step's sampling reads a snapshot of the batch.
    "sync_tp2": (
        {
            "async_scheduling": False,
            "tensor_parallel_size": 2,
            "speculative_config": {"method": "ngram", **NGRAM},
        },
        {
            "VLLM_NEURON_SCHED_DEVICE": "thread",
            "VLLM_CPU_OMP_THREADS_BIND": thread_binding(2),
        },
    ),
    # vLLM's name for the on-device n-gram proposer keeps async scheduling
    # on; every TP rank proposes the same drafts from its own histories.
    "async_tp4": (
        {
            "async_scheduling": True,
            "tensor_parallel_size": TP,
            "speculative_config": {"method": "ngram_gpu", **NGRAM},
        },
        {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP)},
    ),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(
    request: pytest.FixtureRequest, checkpoint: str
) -> Iterator[tuple[str, Any]]:
    kwargs, env = ENGINES[request.param]
    # The engine core in this process (its workers spawned at TP > 1).
    with in_process_llm(checkpoint, env, **ENGINE, **kwargs) as llm:
        yield request.param, llm


@pytest.fixture(scope="module")
def results(engine: tuple[str, Any], checkpoint: str) -> dict[str, Any]:
    name, llm = engine
    records = generate(llm, _prompts(checkpoint), _params(checkpoint))
    return {
        "name": name,
        "records": records,
        "counters": spec_decode_counters(llm),
        "stats": llm.collective_rpc("get_async_scheduling_stats"),
        "ranks": llm.collective_rpc("get_rank_state"),
    }


def test_greedy_tokens_equal_stock_without_speculation(
    results: dict[str, Any], checkpoint: str
) -> None:
    """Stock's greedy tokens with its own (sync) speculation, which are its
    tokens without it: the trained model's greedy output is its successor
    walk from the prompt's last token, whatever the drafts."""
    stock = _stock(checkpoint, speculative=True).result()
    walks = [_walk(checkpoint, i)[:n] for i, n in enumerate(MAX_TOKENS)]
    assert [r["token_ids"] for r in stock][1:] == walks[1:]
    ours = results["records"]
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    assert [r["finish_reason"] for r in ours] == [r["finish_reason"] for r in stock]
    # The stop token ended the first request inside an accepted run.
    assert ours[0]["finish_reason"] == "stop"
    assert ours[0]["token_ids"] == _walk(checkpoint)[:STOP_AT]


def test_logprobs_equal_stock(results: dict[str, Any], checkpoint: str) -> None:
    """Each output token's logprobs (the target's at its position), in
    accepted runs as after a rejection, as stock's with its speculation."""
    stock = _stock(checkpoint, speculative=True).result()
    for ours, theirs in zip(results["records"][1:3], stock[1:3]):
        assert ours["logprobs"] is not None
        assert len(ours["logprobs"]) == len(ours["token_ids"])
        assert_logprobs_close(ours["logprobs"], theirs["logprobs"], 1e-4)


def test_drafts_are_accepted_and_rejected(results: dict[str, Any]) -> None:
    counters = results["counters"]
    assert counters["num_accepted_tokens"] > 0
    assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]


def test_sync_counters_equal_stock(results: dict[str, Any], checkpoint: str) -> None:
    if results["name"] != "sync_tp2":
        pytest.skip("async mode schedules K draft slots per step; see below")
    stock = _stock(checkpoint, speculative=True).result()
    assert results["counters"] == stock[0]["spec_decode"]


def test_async_verify_steps_are_fed_from_the_device(results: dict[str, Any]) -> None:
    if results["name"] != "async_tp4":
        pytest.skip("sync mode reads every step's output before the next")
    assert len(results["stats"]) == TP
    for stats in results["stats"]:
        assert stats["async_steps"] > 0
        assert stats["sync_fallback_steps"] == 0
        assert stats["host_waits"] == 0
    # Every rank finished the requests with the same tokens.
    assert len({rank["finished_digest"] for rank in results["ranks"]}) == 1
    # Every verify step offered K drafts per row, accepted or not.
    counters = results["counters"]
    assert counters["num_draft_tokens"] == K * counters["num_drafts"]


def test_seeded_sampling_reproduces(engine: tuple[str, Any], checkpoint: str) -> None:
    """Temperature, top-k and top-p go through the rejection sampler's random
    path; a seed gives the same tokens again, and alone as in a batch."""
    _, llm = engine
    params = {
        "temperature": 1.5,
        "top_k": 50,
        "top_p": 0.95,
        "seed": 7,
        "max_tokens": 20,
    }
    prompts = _prompts(checkpoint)[1:3]
    first = generate(llm, prompts, params)
    again = generate(llm, prompts, params)
    alone = generate(llm, prompts[:1], params)
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]
    assert alone[0]["token_ids"] == first[0]["token_ids"]
    assert all(len(r["token_ids"]) == 20 for r in first)


def test_structured_outputs_equal_stock_without_speculation(
    engine: tuple[str, Any], checkpoint: str
) -> None:
    """The grammar's masks at every query of a verify step, and only drafts
    it has checked accepted: under async scheduling the engine reads the
    drafts back (``take_draft_token_ids``) once the step before has landed."""
    name, llm = engine
    prompts, params = _structured(checkpoint)
    before = spec_decode_counters(llm)
    ours = generate(llm, prompts, params)
    after = spec_decode_counters(llm)
    stock = _stock_structured(checkpoint).result()
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    assert [r["finish_reason"] for r in ours] == [r["finish_reason"] for r in stock]
    # The grammars shaped the output: the choice whole, then EOS; the regex
    # off the walk at its seventh token.
    choice = params[0]["structured_outputs"]["choice"][0]
    assert (ours[0]["text"], ours[0]["finish_reason"]) == (choice, "stop")
    assert re.fullmatch(params[1]["structured_outputs"]["regex"], ours[1]["text"])
    walk = _walk(checkpoint)
    assert ours[1]["token_ids"][:6] == walk[:6] and ours[1]["token_ids"][6] != walk[6]
    # Drafts inside the grammar were accepted.
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"], name


def test_prefix_cache_hits_equal_stock(
    engine: tuple[str, Any], checkpoint: str
) -> None:
    """The prompts again on the same engine: each request starts from a
    prefix-cache hit. A one-token remainder, which vLLM's scheduler pads to
    ``1 + K`` tokens of placeholder drafts, runs its one prompt token and
    samples from it; the drafts come from the whole prompt, the hit
    included. Tokens equal stock's, and in sync mode so do vLLM's acceptance
    counters (the same drafts, proposed from the same histories)."""
    name, llm = engine
    prompts = _prefix_prompts(checkpoint)
    before = spec_decode_counters(llm)
    ours = generate(llm, prompts, PREFIX_PARAMS) + generate(llm, prompts, PREFIX_PARAMS)
    after = spec_decode_counters(llm)
    stock = _stock_prefix(checkpoint).result()
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    succ = successor_map(checkpoint)
    for record, prompt in zip(ours, prompts * 2):
        walk = [succ[prompt[-1]]]
        while len(walk) < PREFIX_PARAMS["max_tokens"]:
            walk.append(succ[walk[-1]])
        assert record["token_ids"] == walk
    if name == "sync_tp2":
        assert counted_since(before, after) == stock[0]["spec_decode"]
