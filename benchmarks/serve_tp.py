"""Output tokens/s of the OpenAI server at TP=4 next to TP=1, same prompts.

    python benchmarks/serve_tp.py [--tp 1 4] [--requests 16] [--max-tokens 64]

Per TP size: starts the server (our platform, async scheduling, the tiny
checkpoint of ``vllm_neuron_sched.demo``) on a free loopback port, sends one
warm-up request, then ``--requests`` concurrent greedy completions of
``--max-tokens`` tokens (ignore_eos), and reports output tokens / wall time
plus the async scheduling counters from ``/metrics``. Workers share the
machine's cores round-robin (``VLLM_CPU_OMP_THREADS_BIND``), so on a 2-core
machine TP=4 measures the cost of the extra ranks, not a speed-up.
"""

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

MODEL = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _thread_binding(tp: int) -> str:
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[rank % len(cores)]) for rank in range(tp))


def start_server(checkpoint: Path, tp: int, max_num_seqs: int, log: Path):
    port = _free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": _thread_binding(tp),
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--tensor-parallel-size", str(tp), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", str(max_num_seqs),
        "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop_server(proc)
    raise TimeoutError(f"server not healthy; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


async def measure(url: str, num_requests: int, max_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    prompts = [f"the request {i} token step batch" for i in range(num_requests)]

    async def one(prompt: str) -> int:
        response = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return response.usage.completion_tokens

    await one("warm up")
    start = time.perf_counter()
    num_tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return num_tokens / (time.perf_counter() - start)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^vllm:neuron_sched_(\w+)_total (\S+)$", text, re.M)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from vllm_neuron_sched.demo import ensure_checkpoint

    checkpoint = ensure_checkpoint()
    logs = Path(tempfile.mkdtemp(prefix="serve_tp_"))
    results = {}
    for tp in args.tp:
        log = logs / f"tp{tp}.log"
        proc, url = start_server(checkpoint, tp, args.requests, log)
        try:
            tokens_per_s = asyncio.run(measure(url, args.requests, args.max_tokens))
            results[tp] = tokens_per_s
            print(f"TP={tp}: {tokens_per_s:.1f} output tok/s  {counters(url)}")
        finally:
            stop_server(proc)
    if 1 in results:
        for tp, value in results.items():
            print(f"TP={tp} / TP=1: {value / results[1]:.2f}")
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
