"""Kill a process of a running OpenAI server mid-stream, and report how
its requests ended and whether every process it had went away.

    report = await kill_mid_stream(server, kill_titled("VLLM::EngineCore"))
"""

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron_sched.testing.server import SERVED_MODEL, OpenAIServer


@dataclass
class DeathReport:
    """What the clients and the process table saw after a kill mid-stream."""

    outcomes: list[str]  # per request: "completed: ..." or "error ...: ..."
    exit_s: float | None  # kill to the API server's exit; None: still running
    survivors: list[Any]  # processes of the server alive 30 s after its exit
    # What a failed check needs to tell a late kill from a lost error: the
    # chunks each stream had read when the kill came, and how long after the
    # requests were sent it came.
    chunks_at_kill: list[int] = field(default_factory=list)
    kill_after_s: float | None = None


def wait_gone(processes: list[Any], timeout_s: float) -> list[Any]:
    """Waits until none of ``processes`` (psutil) runs; returns the ones
    still alive at the timeout (zombies count as gone)."""
    import psutil

    def alive(process: Any) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (left := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_titled(title: str) -> Callable[[list[Any]], None]:
    """SIGKILL to the server's process that vLLM titled ``title``, e.g.
    ``VLLM::Worker_TP2`` or ``VLLM::EngineCore``."""

    def kill(processes: list[Any]) -> None:
        victim = next(p for p in processes if p.cmdline()[:1] == [title])
        victim.send_signal(signal.SIGKILL)

    return kill


async def kill_mid_stream(
    server: OpenAIServer,
    kill: Callable[[list[Any]], None],
    num_streams: int = 3,
    timeout_s: float = 60,
    sim_device_ms: float = 200,
) -> DeathReport:
    """Starts ``num_streams`` long greedy streams and one non-streamed
    request on a device slowed to ``sim_device_ms`` per execution, calls
    ``kill`` with the server's processes once every stream has tokens, and
    reports how the requests ended and whether the server exited within
    ``timeout_s``. Needs ``VLLM_SERVER_DEV_MODE=1`` on the server."""
    import openai

    client = server.client(timeout_s=timeout_s)
    params = {
        "model": SERVED_MODEL,
        "prompt": list(range(10, 20)),
        "max_tokens": 200,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    await client.completions.create(**{**params, "max_tokens": 4})  # warm
    # A slow device keeps every request in flight until the death is noticed
    # (vLLM takes seconds to notice a dead worker) and until the kill comes:
    # on two cores shared with four TP workers the clients may read their
    # first chunks seconds late. The kill waits for three chunks per stream
    # only, so the slowness costs this check about a second, and 200 tokens
    # take over a minute.
    await server.collective_rpc("set_sim_device_ms", [sim_device_ms])
    streaming = asyncio.Barrier(num_streams + 1)
    chunks = [0] * num_streams

    async def stream(index: int) -> str:
        try:
            async for _ in await client.completions.create(stream=True, **params):
                chunks[index] += 1
                if chunks[index] == 3:
                    await streaming.wait()
        except openai.APIError as error:
            return f"error after {chunks[index]} chunks: {error}"
        return f"completed: {chunks[index]} chunks"

    async def complete() -> str:
        try:
            await client.completions.create(**params)
        except openai.APIStatusError as error:
            return f"error {error.status_code}: {error}"
        return "completed"

    sent_at = time.monotonic()
    requests = [asyncio.create_task(stream(i)) for i in range(num_streams)]
    requests.append(asyncio.create_task(complete()))
    await asyncio.wait_for(streaming.wait(), timeout=timeout_s)
    processes = server.processes()
    kill(processes[1:])
    killed_at = time.monotonic()
    chunks_at_kill = list(chunks)
    outcomes = await asyncio.wait_for(asyncio.gather(*requests), timeout=timeout_s)
    while server.proc.poll() is None and time.monotonic() - killed_at < timeout_s:
        await asyncio.sleep(0.2)
    exited = server.proc.poll() is not None
    return DeathReport(
        outcomes=list(outcomes),
        exit_s=time.monotonic() - killed_at if exited else None,
        survivors=wait_gone(processes[1:], timeout_s=30) if exited else [],
        chunks_at_kill=chunks_at_kill,
        kill_after_s=killed_at - sent_at,
    )
