"""``LLM.generate`` through our worker, sync, async and async with
speculative decoding, against stock vLLM CPU.

The oracle is stock vLLM CPU (``VLLM_NEURON_SCHED_DISABLE=1``, set before vLLM
resolves its platform, so it runs in a fresh subprocess: see ``_run_stock``).
Greedy float32 tokens must match it token for token, logprobs and prompt
logprobs within 1e-4. The compatibility matrix (README.md) is proven here for
the per-request features: requests that hold every pair of them, against
stock.
"""

import os
import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest

from vllm_neuron_sched.testing.in_process import in_process
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    generate,
    generate_in_subprocess,
    start_in_subprocess,
)
from vllm_neuron_sched.testing.pairwise import covering_rows
from vllm_neuron_sched.testing.workloads import (
    BLOCK,
    MIXED_BUDGETS,
    MODES,
    SMALL_ENGINE,
    STOCK_ENV,
    greedy,
    mixed_greedy,
    mixed_prompts,
    token_prompts,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = MIXED_BUDGETS
ENGINE = SMALL_ENGINE
NUM_LOGPROBS = 3
TOLERANCE = 1e-4


def _prompts() -> list[list[int]]:
    return mixed_prompts()


def _greedy_params() -> list[dict[str, Any]]:
    return mixed_greedy(NUM_LOGPROBS)


def _run_stock(checkpoint: str, params: list[dict]) -> list[dict]:
    """Stock vLLM CPU in a fresh process: our platform plugin disabled."""
    return generate_in_subprocess(
        checkpoint, _prompts(), params, ENGINE, env=STOCK_ENV, timeout_s=900
    )


@pytest.fixture(scope="module", autouse=True)
def stock_runs(checkpoint_dir: str) -> None:
    """Both stock children start with the module and run while our engines
    start; the fixtures below wait for their results."""
    churn_prompts, churn_params = _churn()
    for prompts, params in (
        (_prompts(), _greedy_params()),
        (churn_prompts, churn_params),
    ):
        start_in_subprocess(
            checkpoint_dir, prompts, params, ENGINE, env=STOCK_ENV, timeout_s=900
        )
    _stock_matrix(checkpoint_dir, speculative=False)
    _stock_matrix(checkpoint_dir, speculative=True)


def _stats(llm: Any) -> dict[str, int]:
    return llm.collective_rpc("get_async_scheduling_stats")[0]


@pytest.fixture(scope="module")
def stock_greedy(checkpoint_dir: str) -> list[dict]:
    return _run_stock(checkpoint_dir, _greedy_params())


# name -> (engine keywords, environment of its workers). Each but "async"
# (the served set-up) runs in this process: seconds to start
# (``testing/in_process.py``). TP=4 async is test_serve_tp4.py's, speculative
# at TP=4 test_speculative.py's and test_draft_model.py's.
ENGINES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "async": ({"async_scheduling": True}, {}),
    # A device thread beside the worker's main thread.
    "async_thread": (
        {"async_scheduling": True},
        {"VLLM_NEURON_SCHED_DEVICE": "thread"},
    ),
    "sync": (MODES["sync"], {}),
    # The n-gram proposer on the device, verify steps fed from it.
    "async_ngram": (MODES["async_ngram"], {}),
    # Rectangular prefill shapes (one request per row, rows padded) instead
    # of the default packed rows.
    "async_rectangular": (
        {"async_scheduling": True},
        {"VLLM_NEURON_SCHED_PREFILL_SHAPES": "1x8,1x16,1x32,2x8,2x16,4x8"},
    ),
    # vLLM's own AsyncScheduler (``--scheduler-cls``): it mixes prefill and
    # decode in one step, which our worker must also run.
    "vllm_scheduler": (
        {
            "async_scheduling": True,
            "scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
        },
        {},
    ),
}


SPAWNED = ("async",)


@pytest.fixture(scope="module")
def engines(checkpoint_dir: str) -> Iterator[Callable[[str], Any]]:
    """Each engine of ``ENGINES`` started once per module, on first use."""
    from vllm import LLM

    started: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in started:
            kwargs, env = ENGINES[name]
            local = in_process() if name not in SPAWNED else nullcontext()
            with mock.patch.dict(os.environ, env), local:  # workers read it
                started[name] = LLM(model=checkpoint_dir, **ENGINE, **kwargs)
        return started[name]

    yield get
    for llm in started.values():
        llm.llm_engine.engine_core.shutdown()
    started.clear()


@pytest.fixture(params=list(ENGINES))
def llm(request: pytest.FixtureRequest, engines: Callable[[str], Any]) -> Any:
    return engines(request.param)


def test_greedy_matches_stock_vllm(llm: Any, stock_greedy: list[dict]) -> None:
    ours = generate(llm, _prompts(), _greedy_params())
    for our_out, stock_out, max_tokens in zip(ours, stock_greedy, MAX_TOKENS):
        assert len(our_out["token_ids"]) == max_tokens
        assert our_out["token_ids"] == stock_out["token_ids"]
        assert_logprobs_close(our_out["logprobs"], stock_out["logprobs"], TOLERANCE)
        assert_logprobs_close(
            our_out["prompt_logprobs"], stock_out["prompt_logprobs"], TOLERANCE
        )
    assert ours[1]["prompt_logprobs"] is not None  # returned, not dropped


@pytest.fixture(scope="module")
def stock_churn(checkpoint_dir: str) -> list[dict]:
    prompts, params = _churn()
    return generate_in_subprocess(
        checkpoint_dir, prompts, params, ENGINE, env=STOCK_ENV, timeout_s=900
    )


def _churn() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """More requests than sequence slots, prompts across the chunk size,
    different budgets: requests join and leave the batch all the time."""
    lengths = [3, 40, 17, 66, 9, 28, 51, 5, 35, 12, 80, 21]
    budgets = [9, 14, 5, 11, 20, 7, 3, 16, 10, 6, 12, 18]
    return token_prompts(lengths, stride=5, salt=11), greedy(budgets)


@pytest.mark.parametrize("engine", ["async", "async_thread"])
def test_churning_batch_stays_async_and_matches_stock(
    engine: str, engines: Callable[[str], Any], stock_churn: list[dict]
) -> None:
    llm = engines(engine)
    prompts, params = _churn()
    before = _stats(llm)
    ours = generate(llm, prompts, params)
    after = _stats(llm)
    assert [o["token_ids"] for o in ours] == [o["token_ids"] for o in stock_churn]
    delta = {key: after[key] - before[key] for key in after}
    # Every request's prompt has a step of its own; each token after the
    # first comes from a decode step fed from the token table, and the
    # host never got ahead of the engine's reads (counted by structure:
    # the inline device is done at enqueue, and that changes nothing here).
    assert delta["prefill_steps"] >= len(prompts), delta
    assert delta["async_steps"] >= max(p["max_tokens"] for p in params) - 1, delta
    assert delta["sync_fallback_steps"] == 0, delta
    assert delta["host_waits"] == 0, delta


def test_sync_mode_counts_every_sampling_step_as_a_fallback(
    engines: Callable[[str], Any],
) -> None:
    """One request, a prompt of one chunk, 8 tokens: a prefill step that
    samples, then 7 decodes; sync mode hands each one's tokens back."""
    llm_sync = engines("sync")
    before = _stats(llm_sync)
    generate(llm_sync, [_prompts()[0]], greedy([8]))
    after = _stats(llm_sync)
    delta = {key: after[key] - before[key] for key in after}
    assert delta == {
        "async_steps": 0,
        "sync_fallback_steps": 8,
        "prefill_steps": 1,
        "host_waits": 8,
        "dead_tokens": 0,
    }


def test_bad_request_is_refused_and_others_finish(
    engines: Callable[[str], Any],
) -> None:
    llm_async = engines("async")
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="logprobs"):
        llm_async.generate(
            [{"prompt_token_ids": _prompts()[0]}],
            SamplingParams(max_tokens=4, logprobs=10_000),
            use_tqdm=False,
        )
    params = [{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}] * 3
    outputs = generate(llm_async, _prompts()[:3], params)
    assert [len(o["token_ids"]) for o in outputs] == [6, 6, 6]


@pytest.mark.parametrize("engine", ["async", "vllm_scheduler"])
def test_structured_output_in_async_mode(
    engine: str, engines: Callable[[str], Any]
) -> None:
    """Under our chunked-prefill scheduler and under vLLM's AsyncScheduler."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["yes", "no", "maybe"]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    outputs = engines(engine).generate(
        ["the request is", "a token step"], params, use_tqdm=False
    )
    assert all(out.outputs[0].text in choices for out in outputs)


# --- the compatibility matrix: every pair of per-request features -----------

# Each feature's settings (SamplingParams keywords). A request takes one
# setting of each, and every two settings of two features meet in some
# request (a pairwise covering design). Random sampling is seeded; the stop
# tokens and words, bad words and allowed tokens are ones the model's greedy
# outputs hold.
FEATURES: dict[str, list[dict[str, Any]]] = {
    "sampling": [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7},
        {"temperature": 1.0, "min_p": 0.05, "seed": 8},
    ],
    "penalties": [
        {},
        {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2},
    ],
    "stop": [{}, {"stop": ["fexi", "desu"]}, {"stop_token_ids": [17, 380, 321]}],
    "min_tokens": [{}, {"min_tokens": 5}],
    "bad_words": [{}, {"bad_words": ["qu", "gu"]}],
    "allowed_token_ids": [{}, {"allowed_token_ids": list(range(10, 700))}],
    "logit_bias": [{}, {"logit_bias": {530: 4.0, 22: 4.0}}],
    "logprobs": [{}, {"logprobs": 3}],
    "prompt_logprobs": [{}, {"prompt_logprobs": 2}],
    "n": [{}, {"n": 2}],
    "structured_outputs": [
        {},
        {"structured_outputs": {"regex": "(ka|ri|to|su|me)+( (ka|ri|to|su|me)+)*"}},
    ],
}
# The requests run twice on one engine: the second round hits the prefix cache.
MATRIX_ROUNDS = 2
# With speculative decoding vLLM refuses these per request, and so do we: the
# speculative column's requests are greedy (the rejection sampler keeps a
# random request's distribution, not stock's draws) and leave them out.
REFUSED_WITH_SPECULATION = ("logit_bias", "min_p")


def _compatible(settings: list[dict[str, Any]]) -> bool:
    """Allowed tokens and a grammar together can leave no token to take;
    vLLM refuses ``n > 1`` with greedy sampling."""
    merged = {key: value for setting in settings for key, value in setting.items()}
    if {"allowed_token_ids", "structured_outputs"} <= merged.keys():
        return False
    return not (merged.get("n") and merged.get("temperature") == 0.0)


def _matrix(speculative: bool) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The requests: the mixed prompts over and over, those of 64k + 1
    tokens first (run again, they start with a one-token rest, alone in a
    step: what vLLM pads with placeholder drafts when it speculates), each
    with one row of the covering design."""
    features = FEATURES
    if speculative:  # greedy, without what speculation refuses
        left_out = {"seed", "n", *REFUSED_WITH_SPECULATION}
        features = {
            name: [s for s in settings if not left_out & s.keys()]
            for name, settings in FEATURES.items()
        }
    rows = covering_rows(list(features.values()), _compatible)
    params = []
    for row in rows:
        request = {"max_tokens": 12, "ignore_eos": True}
        for setting in row:
            request.update(setting)
        params.append(request)
    prompts = sorted(_prompts(), key=lambda p: len(p) % BLOCK != 1)
    return [prompts[i % len(prompts)] for i in range(len(params))], params


def _stock_matrix(checkpoint: str, speculative: bool) -> Any:
    """Stock with a step's budget for every sequence's whole prompt: a
    chunked seeded prompt makes stock vLLM CPU raise ("CPU Generator does
    not use offset"), and ours samples the same however a prompt is
    chunked."""
    budget = ENGINE["max_num_seqs"] * ENGINE["max_model_len"]
    engine = {**ENGINE, "max_num_batched_tokens": budget}
    return start_in_subprocess(
        checkpoint,
        *_matrix(speculative),
        engine,
        env=STOCK_ENV,
        timeout_s=900,
        rounds=MATRIX_ROUNDS,
    )


@pytest.mark.parametrize("engine", ["sync", "async", "async_ngram"])
def test_every_pair_of_request_features_equals_stock(
    engine: str, engines: Callable[[str], Any], checkpoint_dir: str
) -> None:
    """Tokens of every completion, finish reasons, logprobs and prompt
    logprobs equal stock's, with chunked prompts, and the second time with
    prefix-cache hits."""
    speculative = engine == "async_ngram"
    llm = engines(engine)
    prompts, params = _matrix(speculative)
    ours = [r for _ in range(MATRIX_ROUNDS) for r in generate(llm, prompts, params)]
    stock = _stock_matrix(checkpoint_dir, speculative).result()
    for i, (record, theirs) in enumerate(zip(ours, stock, strict=True)):
        assert record["completions"] == theirs["completions"], (i, params[i])
        assert record["finish_reason"] == theirs["finish_reason"], (i, params[i])
        assert_logprobs_close(record["logprobs"], theirs["logprobs"], TOLERANCE)
        assert_logprobs_close(
            record["prompt_logprobs"], theirs["prompt_logprobs"], TOLERANCE
        )


def test_structured_request_whose_prompt_rest_is_one_token_under_speculation(
    engines: Callable[[str], Any],
) -> None:
    """The same prompt twice, alone: the second time its cached prefix leaves
    one token, which vLLM pads with placeholder drafts (and masks for them)
    when it speculates; the prefill step runs that token and samples under
    its grammar, as the first time."""
    llm = engines("async_ngram")
    prompt = token_prompts([2 * BLOCK + 1], stride=3, salt=5)
    regex = "(ka|ri|to|su|me)+"
    params = [
        {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"regex": regex}}
    ]
    first, again = (generate(llm, prompt, params)[0] for _ in range(2))
    assert first["finish_reason"] in ("stop", "length"), first
    text = llm.get_tokenizer().decode(first["token_ids"], skip_special_tokens=True)
    assert re.fullmatch(regex, text), text
    assert again["token_ids"] == first["token_ids"]
    assert again["finish_reason"] == first["finish_reason"]


def test_speculation_refuses_what_it_cannot_run_and_seeds_reproduce(
    engines: Callable[[str], Any],
) -> None:
    """Per request, logit bias and min_p are refused (by vLLM's front end;
    our scheduler refuses those that reach the engine another way). A
    seeded request's tokens (``n = 2`` among them) are its own, alone or
    batched, and again."""
    from vllm.exceptions import VLLMValidationError

    llm = engines("async_ngram")
    prompts, params = _matrix(speculative=False)
    for name in REFUSED_WITH_SPECULATION:
        i = next(i for i, p in enumerate(params) if p.get(name))
        with pytest.raises(VLLMValidationError, match="with speculative decoding"):
            generate(llm, [prompts[i]], [params[i]])
    seeded = [i for i, p in enumerate(params) if p["temperature"] > 0]
    runnable = [
        {k: v for k, v in params[i].items() if k not in REFUSED_WITH_SPECULATION}
        for i in seeded
    ]
    seeded_prompts = [prompts[i] for i in seeded]
    assert any(p.get("n") for p in runnable)
    batched = generate(llm, seeded_prompts, runnable)
    alone = generate(llm, seeded_prompts[-1:], runnable[-1:])
    again = generate(llm, seeded_prompts, runnable)
    assert [r["completions"] for r in again] == [r["completions"] for r in batched]
    assert alone[0]["completions"] == batched[-1]["completions"]
