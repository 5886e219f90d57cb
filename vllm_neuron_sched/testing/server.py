"""An OpenAI server in a subprocess on a free loopback port, for tests and
benchmarks: start, wait until healthy, read ``/metrics``, stop (always, by
killing its process group).

    with OpenAIServer.start(checkpoint, ["--tensor-parallel-size", "4"],
                            env={"VLLM_CPU_OMP_THREADS_BIND": thread_binding(4)},
                            log=Path("/tmp/server.log")) as server:
        client = server.client()
"""

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_neuron_sched.metrics import METRICS_DIR_ENV
from vllm_neuron_sched.testing.workloads import SERVER_MAX_TOKENS

SERVED_MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def thread_binding(world_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` sharing this process's cores round-robin
    among ``world_size`` workers (TP=4 on 2 cores: ``0|1|0|1``)."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[rank % len(cores)]) for rank in range(world_size))


def engine_args(engine: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enforce_eager": True}`` -> CLI flags."""
    args: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's whole group (it was started in a session of
    its own), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


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


def _server_env(env: dict[str, str] | None) -> dict[str, str]:
    return {
        # Each server makes its own metrics directory.
        **{k: v for k, v in os.environ.items() if k != METRICS_DIR_ENV},
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **(env or {}),
    }


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """In a session of its own, so that stopping it reaches every process
    it spawns."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class HeadlessNode:
    """``vllm serve --headless``: the workers of one more node of a multi-node
    engine, no API server (pass the ``--nnodes``/``--node-rank``/
    ``--master-*`` flags in ``args``)."""

    def __init__(
        self,
        model: str | Path,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [
            sys.executable, "-m", "vllm_neuron_sched.cli", "serve", str(model),
            "--headless", *args,
        ]  # fmt: skip
        self.proc = _spawn(command, _server_env(env), log)
        self.log = log

    def __enter__(self) -> "HeadlessNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self) -> None:
        """The node dies: every process on it, at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        stop_group(self.proc)


class OpenAIServer:
    """A running ``vllm.entrypoints.openai.api_server`` process."""

    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    @classmethod
    def start(
        cls,
        model: str | Path,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        timeout_s: float = 600,
    ) -> "OpenAIServer":
        """Starts the server (served as ``SERVED_MODEL``) and waits until
        ``/health`` answers; stops it and raises if it dies or never does."""
        port = free_port()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1", "--port", str(port), *args,
        ]  # fmt: skip
        proc = _spawn(command, _server_env(env), log)
        server = cls(f"http://127.0.0.1:{port}", proc, log)
        try:
            server.wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy in {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_group(self.proc)

    def client(self, timeout_s: float = 120) -> Any:
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout_s,
        )

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples, summed over label sets."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    async def ametrics(self) -> dict[str, float]:
        return parse_metrics(await self.ametrics_text())

    async def ametrics_text(self) -> str:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"{self.url}/metrics", timeout=30)).text

    async def wait_idle(self, timeout_s: float = 60) -> dict[str, float]:
        """``/metrics`` once no request runs or waits and no KV block is in
        use (or the last sample, at the timeout: the caller asserts)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = await self.ametrics()
            idle = (
                metrics["vllm:num_requests_running"] == 0
                and metrics["vllm:num_requests_waiting"] == 0
                and metrics["vllm:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return metrics
            await asyncio.sleep(0.2)

    async def rank_states(self) -> list[dict[str, Any]]:
        """Every rank's ``get_rank_state``."""
        return await self.collective_rpc("get_rank_state")

    async def collective_rpc(self, method: str, args: list[Any] = ()) -> list[Any]:
        """A worker method on every rank (needs ``VLLM_SERVER_DEV_MODE=1``)."""
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{self.url}/collective_rpc",
                json={"method": method, "args": list(args)},
                timeout=60,
            )
        response.raise_for_status()
        return response.json()["results"]

    def processes(self) -> list[Any]:
        """The server and every process under it (engine core, workers)."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process tree."""
        import psutil

        total = 0
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_info().rss
        return total


async def greedy_completion(
    client: Any,
    prompt: list[int],
    stream: bool = False,
    max_tokens: int = SERVER_MAX_TOKENS,
    **params: Any,
) -> list[int]:
    """Greedy token ids of one completion from an ``openai`` client, streamed
    or not (EOS ignored); ``params`` go to ``completions.create``, their
    ``extra_body`` merged into ours."""
    extra_body = {"ignore_eos": True, "return_token_ids": True}
    extra_body.update(params.pop("extra_body", {}))
    request = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "extra_body": extra_body,
        **params,
    }
    if not stream:
        response = await client.completions.create(**request)
        return list(response.choices[0].token_ids)
    token_ids: list[int] = []
    async for chunk in await client.completions.create(stream=True, **request):
        token_ids += chunk.choices[0].token_ids or []
    return token_ids


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """One metric's samples summed per value of one label, e.g. per
    ``engine`` (data-parallel replica)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} ([-+\w.]+)$", line)
        if not match or match.group(1) != name:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if label in labels:
            key = labels[label]
            values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([-+\w.]+)$", line)
        if match:
            name = match.group(1)
            values[name] = values.get(name, 0.0) + float(match.group(3))
    return values


@dataclass
class DeathReport:
    """What the clients and the process table saw after a kill mid-stream."""

    outcomes: list[str]  # per request: "completed: ..." or "error ...: ..."
    exit_s: float | None  # kill to the API server's exit; None: still running
    survivors: list[Any]  # processes of the server alive 30 s after its exit


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
    sim_device_ms: float = 50,
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
    # (vLLM takes seconds to notice a dead worker).
    await server.collective_rpc("set_sim_device_ms", [sim_device_ms])
    streaming = asyncio.Barrier(num_streams + 1)

    async def stream() -> str:
        num_chunks = 0
        try:
            async for _ in await client.completions.create(stream=True, **params):
                num_chunks += 1
                if num_chunks == 3:
                    await streaming.wait()
        except openai.APIError as error:
            return f"error after {num_chunks} chunks: {error}"
        return f"completed: {num_chunks} chunks"

    async def complete() -> str:
        try:
            await client.completions.create(**params)
        except openai.APIStatusError as error:
            return f"error {error.status_code}: {error}"
        return "completed"

    requests = [asyncio.create_task(stream()) for _ in range(num_streams)]
    requests.append(asyncio.create_task(complete()))
    await asyncio.wait_for(streaming.wait(), timeout=timeout_s)
    processes = server.processes()
    kill(processes[1:])
    killed_at = time.monotonic()
    outcomes = await asyncio.wait_for(asyncio.gather(*requests), timeout=timeout_s)
    while server.proc.poll() is None and time.monotonic() - killed_at < timeout_s:
        await asyncio.sleep(0.2)
    exited = server.proc.poll() is not None
    return DeathReport(
        outcomes=list(outcomes),
        exit_s=time.monotonic() - killed_at if exited else None,
        survivors=wait_gone(processes[1:], timeout_s=30) if exited else [],
    )
