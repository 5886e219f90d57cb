"""An OpenAI server in a subprocess on a free loopback port, for tests and
benchmarks: start, wait until healthy, read ``/metrics``, stop (always, by
killing its process group). Parsing ``/metrics`` is ``metrics_scrape``'s;
killing a server's process mid-stream is ``kills``'.

    env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(4)}  # binding.py
    with OpenAIServer.start(checkpoint, ["--tensor-parallel-size", "4"],
                            log=Path("/tmp/server.log"), env=env) as server:
        client = server.client()
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from vllm_neuron_sched.metrics import METRICS_DIR_ENV
from vllm_neuron_sched.testing.metrics_scrape import parse_metrics
from vllm_neuron_sched.testing.workloads import SERVER_MAX_TOKENS

SERVED_MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_args(engine: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enforce_eager": True}`` -> CLI flags
    (``False``: ``--no-...``; a dict: JSON)."""
    args: list[str] = []
    for key, value in engine.items():
        name = key.replace("_", "-")
        if value is True:
            args.append(f"--{name}")
        elif value is False:
            args.append(f"--no-{name}")
        elif isinstance(value, dict):
            args += [f"--{name}", json.dumps(value)]
        else:
            args += [f"--{name}", str(value)]
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


# Longer than the clients' pool keeps an idle connection (httpx: 5 s, as
# vLLM's default here). With equal limits the server may close an idle
# connection just as a client sends on it, and with ``max_retries=0`` that
# request fails with a connection error that says nothing about the server.
KEEP_ALIVE_S = "60"


def _server_env(env: dict[str, str] | None) -> dict[str, str]:
    return {
        # Each server makes its own metrics directory.
        **{k: v for k, v in os.environ.items() if k != METRICS_DIR_ENV},
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": KEEP_ALIVE_S,
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


# What the tests' servers run their engine cores and workers at, below the
# API server and the clients. vLLM's message queues spin (``sched_yield``) for a
# second after each message; four TP workers and the engine core spinning on
# two cores left the test's own process, a shell loop beside it, and the API
# server without a time slice for up to 90 s (measured, Linux 6.18): streams
# read their chunks a minute late and a kill meant for mid-stream came after
# the end. On a serving machine the clients are elsewhere and each worker has
# cores of its own.
TEST_ENGINE_NICENESS = 10


def process_tree(proc: subprocess.Popen) -> list[Any]:
    """``proc`` and every process under it (psutil), ``proc`` first."""
    import psutil

    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def lower_priority(processes: list[Any], niceness: int) -> None:
    """Every thread of ``processes`` (psutil) to ``niceness``: Linux keeps it
    per thread, and the spinning ones are not always the main thread."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            for thread in process.threads():
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, thread.id, niceness)


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

    def processes(self) -> list[Any]:
        """The node's processes: ``serve --headless`` and every one under it."""
        return process_tree(self.proc)

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
        engine_niceness: int = 0,
    ) -> "OpenAIServer":
        """Starts the server (served as ``SERVED_MODEL``) and waits until
        ``/health`` answers; stops it and raises if it dies or never does.
        ``engine_niceness``: every process under the API server runs at it
        (``TEST_ENGINE_NICENESS`` in the tests)."""
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
            if engine_niceness:
                lower_priority(server.processes()[1:], engine_niceness)
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
        return process_tree(self.proc)

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
