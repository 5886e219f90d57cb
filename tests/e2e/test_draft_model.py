"""Speculative decoding with a draft model on the device, through
``LLM.generate``, sync and async at TP=4, against stock vLLM CPU without
speculation.

The trained draft (``testing/checkpoint.py``) follows the target's successor
map on every other cycle and walks the others backwards, so a prompt in an
agreeing cycle has every draft accepted and a prompt in a reversed cycle
none. Its KV heads differ from the target's: both share one KV cache group of
different page sizes.
"""

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
# Budgets that are no multiple of 1 + K, so a run ends inside a verify step.
MAX_TOKENS = [26, 17, 30, 11]
# The first request stops at its third output token: inside the first verify
# step, whose drafts are all accepted.
STOP_AT = 3


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    target, draft = ensure_trained_checkpoints()
    return str(target), str(draft)


def _prompts(
    target: str, draft: str, agree: bool, lengths: tuple[int, int] = (12, 40)
) -> list[list[int]]:
    """Prompts whose walk the draft follows (``agree``) or reverses: a short
    one, and one of several prefill chunks (the chunk is 32 tokens)."""
    succ, draft_succ = successor_map(target), successor_map(draft)

    def draft_agrees(seed: int) -> bool:
        last = repeat_prompt_ids(target, seed, length=lengths[0])[-1]
        return succ[last] == draft_succ[last]

    seeds = [seed for seed in range(200) if draft_agrees(seed) == agree]
    return [
        repeat_prompt_ids(target, seeds[0], length=lengths[0]),
        repeat_prompt_ids(target, seeds[1], length=lengths[1], noise=3),
    ]


def _prefix_prompts(target: str, draft: str) -> list[list[int]]:
    """Prompts of ``PREFIX_HIT_LENGTHS``: run again, each hits the prefix
    cache for all but its last token, which vLLM pads with placeholder
    drafts. The draft agrees with the first, not with the second."""
    lengths = (PREFIX_HIT_LENGTHS[0], PREFIX_HIT_LENGTHS[1] - 3)  # 3 noise tokens
    agreeing = _prompts(target, draft, True, lengths)
    reversed_ = _prompts(target, draft, False, lengths)
    return [agreeing[0], reversed_[1]]


PREFIX_PARAMS = {"temperature": 0.0, "max_tokens": 18, "ignore_eos": True}


def _stock_prefix(target: str, draft: str) -> Any:
    """Stock without speculation, the prompts twice on one engine."""
    prompts = _prefix_prompts(target, draft)
    return start_in_subprocess(
        target, prompts, PREFIX_PARAMS, ENGINE, env=STOCK_ENV, rounds=2
    )


def _all_prompts(target: str, draft: str) -> list[list[int]]:
    """Four prompts of known walks, then four with penalties, allowed tokens,
    min_tokens and bad words (``_params``)."""
    agreeing, reversed_ = _prompts(target, draft, True), _prompts(target, draft, False)
    return [
        agreeing[0],
        reversed_[0],
        agreeing[1],
        reversed_[1],
        *agreeing,
        *agreeing,
    ]


def _walk(target: str, prompt: list[int], n: int) -> list[int]:
    succ = successor_map(target)
    tokens = [prompt[-1]]
    for _ in range(n):
        tokens.append(succ[tokens[-1]])
    return tokens[1:]


def _params(target: str, draft: str) -> list[dict[str, Any]]:
    params = [
        {"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in MAX_TOKENS
    ]
    prompts = _all_prompts(target, draft)
    params[0]["stop_token_ids"] = [_walk(target, prompts[0], STOP_AT)[-1]]
    # Penalties at every verify query: the walk repeats its cycle, which they
    # push away from; allowed tokens that leave out every other step of it.
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    params.append(
        {
            **greedy,
            "repetition_penalty": 20.0,
            "presence_penalty": 2.0,
            "frequency_penalty": 2.0,
        }
    )
    walk = _walk(target, prompts[5], 24)
    params.append({**greedy, "allowed_token_ids": sorted({*walk[:3], 7, 8, 9})})
    # The walk's second token stops the request, but not before six tokens:
    # masked at the verify queries that would come sooner.
    walk = _walk(target, prompts[6], 24)
    params.append({**greedy, "stop_token_ids": [walk[1]], "min_tokens": 6})
    # A bad word: a token of the walk, as text (vLLM tokenizes it again).
    params.append({**greedy, "bad_words": [_bad_word(target, prompts[7])]})
    return params


def _bad_word(target: str, prompt: list[int]) -> str:
    """The text of the first token of the prompt's walk (after the first)
    that the tokenizer gives back as that one token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    for token in _walk(target, prompt, 24)[1:]:
        text = tokenizer.decode([token])
        if tokenizer.encode(text, add_special_tokens=False) == [token]:
            return text
    raise AssertionError("no token of the walk survives decoding")


def _stock(target: str, draft: str) -> Any:
    return start_in_subprocess(
        target,
        _all_prompts(target, draft),
        _params(target, draft),
        ENGINE,
        env=STOCK_ENV,
    )


@pytest.fixture(scope="module", autouse=True)
def stock_runs(checkpoints: tuple[str, str]) -> None:
    """The stock children (no speculation) start while our engines start."""
    _stock(*checkpoints)
    _stock_prefix(*checkpoints)


# name -> (engine keywords, environment of its workers)
ENGINES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # A device thread beside the worker's main thread.
    "sync": ({"async_scheduling": False}, {"VLLM_NEURON_SCHED_DEVICE": "thread"}),
    # Target and draft sharded over four ranks (the draft's four query heads,
    # its one KV head replicated).
    "async_tp4": (
        {"async_scheduling": True, "tensor_parallel_size": TP},
        {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP)},
    ),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(
    request: pytest.FixtureRequest, checkpoints: tuple[str, str]
) -> Iterator[tuple[str, Any]]:
    target, draft = checkpoints
    kwargs, env = ENGINES[request.param]
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    # The engine core in this process (its workers spawned at TP > 1).
    with in_process_llm(
        target, env, **ENGINE, **kwargs, speculative_config=speculative
    ) as llm:
        yield request.param, llm


@pytest.fixture(scope="module")
def results(engine: tuple[str, Any], checkpoints: tuple[str, str]) -> dict[str, Any]:
    name, llm = engine
    records = generate(llm, _all_prompts(*checkpoints), _params(*checkpoints))
    return {
        "name": name,
        "records": records,
        "stats": llm.collective_rpc("get_async_scheduling_stats"),
        "ranks": llm.collective_rpc("get_rank_state"),
    }


def test_greedy_tokens_equal_stock_without_speculation(
    results: dict[str, Any], checkpoints: tuple[str, str]
) -> None:
    target, draft = checkpoints
    stock = _stock(target, draft).result()
    prompts = _all_prompts(target, draft)
    walks = [_walk(target, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    stock_tokens = [r["token_ids"] for r in stock]
    assert stock_tokens[:4] == [walks[0][:STOP_AT], *walks[1:]]
    # Penalties and allowed tokens moved stock off the walk.
    for request in (4, 5, 6, 7):
        assert stock_tokens[request] != _walk(target, prompts[request], 24)
    ours = results["records"]
    assert [r["token_ids"] for r in ours] == stock_tokens
    assert [r["finish_reason"] for r in ours] == [r["finish_reason"] for r in stock]
    assert ours[0]["finish_reason"] == "stop"


def _counted(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Speculation counters of one generate call (vLLM's, as deltas)."""
    before = spec_decode_counters(llm)
    generate(llm, prompts, {"temperature": 0.0, "max_tokens": max_tokens})
    return counted_since(before, spec_decode_counters(llm))


def test_agreeing_drafts_are_all_accepted(
    engine: tuple[str, Any], checkpoints: tuple[str, str]
) -> None:
    _, llm = engine
    counted = _counted(llm, _prompts(*checkpoints, agree=True), 21)
    assert counted["num_drafts"] > 0
    assert counted["num_accepted_tokens"] == counted["num_draft_tokens"]


def test_reversed_drafts_are_all_rejected(
    engine: tuple[str, Any], checkpoints: tuple[str, str]
) -> None:
    _, llm = engine
    counted = _counted(llm, _prompts(*checkpoints, agree=False), 21)
    assert counted["num_draft_tokens"] > 0
    assert counted["num_accepted_tokens"] == 0


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


def test_seeded_sampling_reproduces(
    engine: tuple[str, Any], checkpoints: tuple[str, str]
) -> None:
    """The rejection sampler's random path with the draft's proposals."""
    _, llm = engine
    params = {"temperature": 1.5, "top_k": 50, "seed": 7, "max_tokens": 20}
    prompts = _all_prompts(*checkpoints)[:2]
    first = generate(llm, prompts, params)
    alone = generate(llm, prompts[1:], params)
    assert alone[0]["token_ids"] == first[1]["token_ids"]
    assert all(len(r["token_ids"]) == 20 for r in first)


def test_a_run_to_max_model_len(
    engine: tuple[str, Any], checkpoints: tuple[str, str]
) -> None:
    """The last verify steps' drafts and the draft's lookahead reach past
    ``max_model_len``: no position past it runs, and the request ends there."""
    _, llm = engine
    target, draft = checkpoints
    prompt = _prompts(target, draft, agree=True)[0]
    budget = ENGINE["max_model_len"] - len(prompt)
    records = generate(llm, [prompt], {"temperature": 0.0, "max_tokens": budget})
    assert records[0]["token_ids"] == _walk(target, prompt, budget)
    assert records[0]["finish_reason"] == "length"


def test_prefix_cache_hits_equal_stock(
    engine: tuple[str, Any], checkpoints: tuple[str, str]
) -> None:
    """The prompts again on the same engine: each starts from a prefix-cache
    hit (the target's and the draft's KV of the hit blocks), its one-token
    remainder padded by vLLM with placeholder drafts. Tokens equal stock's
    without speculation, and the agreeing prompt's drafts are accepted."""
    _, llm = engine
    prompts = _prefix_prompts(*checkpoints)
    before = spec_decode_counters(llm)
    ours = generate(llm, prompts, PREFIX_PARAMS)
    first = counted_since(before, spec_decode_counters(llm))
    ours += generate(llm, prompts, PREFIX_PARAMS)
    stock = _stock_prefix(*checkpoints).result()
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    target = checkpoints[0]
    walks = [_walk(target, p, PREFIX_PARAMS["max_tokens"]) for p in prompts]
    assert [r["token_ids"] for r in ours] == walks * 2
    assert first["num_accepted_tokens"] > 0
