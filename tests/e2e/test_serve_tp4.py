"""``vllm serve`` with TP=4 and async scheduling, through the OpenAI API.

One TP=4 server per module (a subprocess on a free loopback port, always
stopped by killing its process group). Four workers share two cores with
``VLLM_CPU_OMP_THREADS_BIND="0|1|0|1"``. Greedy float32 outputs must equal
our platform at TP=1 and stock vLLM CPU (``VLLM_NEURON_SCHED_DISABLE=1``);
the per-rank state must agree across ranks; aborted streams free their
blocks; bad requests get a 400 while others are served; ``/metrics`` shows
the async scheduling counters. Then a soak with real clients
(``testing/soak.py``, fewer requests than at TP=1 in ``test_serve_soak.py``),
and last ``kill -9`` of one TP rank mid-stream: every request in flight gets
an error, the API server exits within 60 s, no process outlives it (the
engine core's death is ``test_serve_soak.py``'s).
"""

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import openai
import pytest

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.kills import kill_mid_stream, kill_titled
from vllm_neuron_sched.testing.oracle import start_greedy_tokens
from vllm_neuron_sched.testing.server import (
    SERVED_MODEL,
    TEST_ENGINE_NICENESS,
    OpenAIServer,
    engine_args,
    greedy_completion,
)
from vllm_neuron_sched.testing.soak import run_soak
from vllm_neuron_sched.testing.workloads import (
    SERVER_MAX_TOKENS,
    SOAK_ENGINE,
    STOCK_ENV,
    server_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TP = 4
MODEL = SERVED_MODEL
# The soak's engine (16 sequences); the oracles' run 4, as SERVER_ENGINE's do.
ENGINE = SOAK_ENGINE
# Each completed request is replayed alone, at TP=4 on two cores about 2 s
# each: 16 requests of a mix that holds every kind (a refused one, a client
# that disconnects, grammars, stop strings, logprobs).
NUM_SOAK_REQUESTS = 16
SOAK_SEED = 32
START_TIMEOUT_S = 300
MAX_TOKENS = SERVER_MAX_TOKENS
# Per device execution, where a test needs requests to outlast the clients'
# reactions (about 0.3 s a step: 200 tokens take a minute).
SLOW_DEVICE_MS = 100


def _prompts() -> list[list[int]]:
    return server_prompts()


@pytest.fixture(scope="module")
def server(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("serve_tp4") / "server.log"
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Exposes POST /collective_rpc (the per-rank state check).
        "VLLM_SERVER_DEV_MODE": "1",
    }
    args = ["--tensor-parallel-size", str(TP), *engine_args(ENGINE)]
    with OpenAIServer.start(
        checkpoint_dir, args, log, env, START_TIMEOUT_S, TEST_ENGINE_NICENESS
    ) as server:
        yield server


@pytest.fixture
def client(server: OpenAIServer) -> openai.AsyncOpenAI:
    return server.client()


@pytest.fixture(scope="module")
def oracle_tokens(
    oracle_runs: dict[str, Future[list[list[int]]]],
) -> dict[str, list[list[int]]]:
    """Greedy tokens of our platform at TP=1 and of stock vLLM CPU."""
    return {name: run.result() for name, run in oracle_runs.items()}


@pytest.fixture(scope="module", autouse=True)
def oracle_runs(checkpoint_dir: str) -> dict[str, Future[list[list[int]]]]:
    """Started with the module (or by the data-parallel and two-node tests,
    whose oracles these are): the children run while the server starts."""
    engine = {**ENGINE, "max_num_seqs": 4}
    return {
        name: start_greedy_tokens(checkpoint_dir, _prompts(), MAX_TOKENS, engine, env)
        for name, env in {"tp1": {}, "stock": STOCK_ENV}.items()
    }


async def test_concurrent_completions_equal_tp1_and_stock_vllm(
    client: openai.AsyncOpenAI, oracle_tokens: dict[str, list[list[int]]]
) -> None:
    prompts = _prompts()
    results = await asyncio.gather(
        *(
            greedy_completion(client, prompt, stream=i % 2 == 0)
            for i, prompt in enumerate(prompts)
        ),
        *(
            greedy_completion(client, prompt, stream=i % 2 == 1)
            for i, prompt in enumerate(prompts)
        ),
    )
    first, second = results[: len(prompts)], results[len(prompts) :]
    assert all(len(tokens) == MAX_TOKENS for tokens in first)
    assert first == second  # streamed == non-streamed
    assert first == oracle_tokens["tp1"]
    assert first == oracle_tokens["stock"]


async def test_chat_streaming_equals_non_streaming(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "the request token step batch"}]
    params = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole, stream = await asyncio.gather(
        client.chat.completions.create(**params),
        client.chat.completions.create(stream=True, **params),
    )
    streamed = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert whole.choices[0].message.content == streamed
    assert streamed


async def test_ranks_agree_and_futures_stay_bounded(
    server: OpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """Every rank ends with the same token histories (the non-output ranks,
    whose outputs nobody reads, do not drift) and never holds more than two
    steps in flight; two at once shows the depth-2 batch queue at work."""
    before = await server.rank_states()
    prompts = [prompt[:8] for prompt in _prompts()]
    *_, mid_run = await asyncio.gather(
        *(greedy_completion(client, p, stream=True, max_tokens=64) for p in prompts),
        server.rank_states(),  # mid-run when the server is quick enough
    )
    after = await server.rank_states()
    for states in (before, mid_run, after):
        assert sorted(s["tp_rank"] for s in states) == list(range(TP))
        assert len({s["history_digest"] for s in states}) == 1, states
        assert len({s["finished_digest"] for s in states}) == 1, states
        assert all(s["max_in_flight_steps"] <= 2 for s in states), states
    assert after[0]["finished_digest"] != before[0]["finished_digest"]
    assert all(s["max_in_flight_steps"] == 2 for s in after), after
    # At most the last step, until the worker runs something (soak.py).
    assert all(s["in_flight_steps"] <= 1 for s in after), after


_DISCONNECTING_CLIENT = """
import http.client, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
headers = {"Content-Type": "application/json"}
conn.request("POST", "/v1/completions", sys.argv[2], headers)
response = conn.getresponse()
assert response.status == 200, response.status
num_chunks = 0
while num_chunks < 3:
    num_chunks += response.fp.readline().startswith(b"data:")
"""


async def test_disconnect_aborts_at_once_and_frees_its_blocks(
    server: OpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """A client that reads three chunks and goes away stops costing steps
    long before its 200 tokens: the next request does not wait behind it."""
    body = {
        "model": MODEL,
        "prompt": _prompts()[0],
        "max_tokens": 200,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    before = await server.ametrics()
    # A slow device, so that the abandoned request's 200 tokens take a minute:
    # on 2 cores the API server that notices the disconnect competes with
    # four busy workers, and at full speed the engine ran all 200 before it
    # did (seen in CI).
    await server.collective_rpc("set_sim_device_ms", [SLOW_DEVICE_MS])
    try:
        # A client process that reads three chunks and exits: its socket closes.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DISCONNECTING_CLIENT, server.url, json.dumps(body)
        )
        assert await asyncio.wait_for(proc.wait(), timeout=120) == 0
        other = await greedy_completion(client, _prompts()[0], stream=True)
        assert len(other) == MAX_TOKENS
    finally:
        await server.collective_rpc("set_sim_device_ms", [0])

    after = await server.wait_idle()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    counters = [
        f"vllm:neuron_sched_{c}_total"
        for c in ("prefill_steps", "async_steps", "sync_fallback_steps")
    ]
    steps = sum(after[c] - before.get(c, 0) for c in counters)
    # Two prefills, the other request's 16 steps, and the abandoned request
    # cut well before its 200: the abort reaches the scheduler within a few
    # steps on an idle machine (21 steps in all, measured). A server that
    # ignored the disconnect would run 2 + 200 or more.
    assert steps <= 2 + MAX_TOKENS + 100, steps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 1000}, "cannot be greater than max_model_len=256"),
        ({"logprobs": 50}, "greater than max allowed: 20"),
        ({"prompt": list(range(10, 310))}, "maximum context length is 256"),
    ],
    ids=["max_tokens", "logprobs", "prompt_too_long"],
)
async def test_bad_request_is_400_while_others_are_served(
    client: openai.AsyncOpenAI, kwargs: dict[str, Any], message: str
) -> None:
    good = asyncio.create_task(greedy_completion(client, _prompts()[1], stream=True))
    params = {
        "model": MODEL,
        "prompt": _prompts()[0],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        **kwargs,
    }
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(**params)
    assert error.value.status_code == 400
    assert message in str(error.value)
    assert len(await good) == MAX_TOKENS


async def test_metrics_count_async_steps_and_dead_tokens(
    server: OpenAIServer, client: openai.AsyncOpenAI
) -> None:
    prompt = _prompts()[1]
    greedy = await greedy_completion(client, prompt, stream=False)
    # A token that greedy decoding produces first at a position >= 3: a
    # request that stops on it ends mid-run, with the next step scheduled.
    stop_at = next(i for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    before = await server.ametrics()

    stopped = await greedy_completion(
        client, prompt, stream=False, extra_body={"stop_token_ids": [greedy[stop_at]]}
    )
    assert stopped == greedy[: stop_at + 1]

    deadline = time.monotonic() + 30
    name = "vllm:neuron_sched_dead_tokens_total"
    while True:
        after = await server.ametrics()
        if after.get(name, 0) > before.get(name, 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert after[name] > before.get(name, 0)

    def delta(counter: str) -> float:
        key = f"vllm:neuron_sched_{counter}_total"
        return after.get(key, 0) - before.get(key, 0)

    # The prompt's prefill, then a decode step per token after the first (and
    # the dead one), none of which made the host wait for the device.
    assert delta("prefill_steps") >= 1
    assert delta("async_steps") >= stop_at
    assert delta("sync_fallback_steps") == 0
    assert delta("host_waits") == 0


async def test_soak_with_real_clients(server: OpenAIServer) -> None:
    await run_soak(server, NUM_SOAK_REQUESTS, tp=TP, seed=SOAK_SEED)


async def test_killed_rank_fails_requests_and_server_exits(
    server: OpenAIServer,
) -> None:
    """Last in the module: it ends the module's server."""
    report = await kill_mid_stream(server, kill_titled("VLLM::Worker_TP2"))
    assert all(o.startswith("error") for o in report.outcomes), report
    assert report.outcomes[-1].startswith("error 5"), report  # not streamed
    assert report.exit_s is not None, f"API server hangs\n{server.log_tail()}"
    assert not report.survivors, report
