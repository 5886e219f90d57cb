"""A process of the TP=4 async server killed mid-stream: one TP rank, or the
engine core.

With async scheduling up to two steps are in flight when a process dies, and
each of our workers runs a device thread. Neither may change what vLLM does
on its own: every request in flight gets an error (an error event in a
stream, a 5xx otherwise), the API server exits within 60 s instead of
hanging, and no engine or worker process outlives it.
"""

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import psutil
import pytest

from vllm_neuron_sched.testing.server import (
    SERVED_MODEL,
    OpenAIServer,
    engine_args,
    thread_binding,
    wait_gone,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

TP = 4
ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "seed": 0,
    "enforce_eager": True,
}
NUM_STREAMS = 3
EXIT_TIMEOUT_S = 60


def _vllm_processes(server: OpenAIServer) -> list[psutil.Process]:
    """The engine core and workers, by the titles vLLM gives them."""
    found = []
    for process in server.processes()[1:]:
        try:
            if process.cmdline() and process.cmdline()[0].startswith("VLLM::"):
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def server(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("death") / "server.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP)}
    args = ["--tensor-parallel-size", str(TP), *engine_args(ENGINE)]
    with OpenAIServer.start(checkpoint_dir, args, log, env, timeout_s=300) as server:
        yield server


async def _stream(client: openai.AsyncOpenAI, started: asyncio.Event) -> str:
    """Streams a long greedy completion; returns how it ended."""
    stream = await client.completions.create(
        model=SERVED_MODEL,
        prompt=list(range(10, 20)),
        max_tokens=240,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    num_chunks = 0
    try:
        async for _ in stream:
            num_chunks += 1
            if num_chunks == 3:
                started.set()
    except openai.APIError as error:
        return f"error after {num_chunks} chunks: {error}"
    return f"completed: {num_chunks} chunks"


async def _complete(client: openai.AsyncOpenAI) -> str:
    try:
        await client.completions.create(
            model=SERVED_MODEL,
            prompt=list(range(10, 20)),
            max_tokens=240,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    except openai.APIStatusError as error:
        return f"error {error.status_code}: {error}"
    return "completed"


@pytest.mark.parametrize("victim", ["VLLM::Worker_TP2", "VLLM::EngineCore"])
async def test_killed_process_fails_requests_and_server_exits(
    server: OpenAIServer, victim: str
) -> None:
    client = server.client(timeout_s=120)
    assert await _complete(client) == "completed"  # warm
    workers = _vllm_processes(server)
    assert len(workers) == TP + 1, [w.cmdline()[0] for w in workers]

    started = asyncio.Event()
    requests = [
        *(asyncio.create_task(_stream(client, started)) for _ in range(NUM_STREAMS)),
        asyncio.create_task(_complete(client)),
    ]
    await asyncio.wait_for(started.wait(), timeout=120)
    target = next(p for p in workers if p.cmdline()[0] == victim)
    target.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()

    outcomes: list[Any] = await asyncio.wait_for(
        asyncio.gather(*requests), timeout=EXIT_TIMEOUT_S
    )
    assert all(o.startswith("error") for o in outcomes), outcomes
    assert outcomes[-1].startswith("error 5"), outcomes

    while server.proc.poll() is None:
        assert time.monotonic() - killed_at < EXIT_TIMEOUT_S, "server hangs"
        await asyncio.sleep(0.2)
    # vLLM 0.32's API server stops gracefully on a dead engine (exit code 0,
    # the same with stock vLLM); what matters is that it does not hang.
    assert not wait_gone(workers, timeout_s=30), "outlived the API server"
