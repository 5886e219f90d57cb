"""Output tokens/s of the OpenAI server at TP=4 next to TP=1, same prompts.

    python benchmarks/serve_tp.py [--tp 1 4] [--requests 16] [--max-tokens 64]

Per TP size: starts the server (our platform, async scheduling, the demo's
tiny checkpoint) on a free loopback port, sends one warm-up request, then
``--requests`` concurrent greedy completions of ``--max-tokens`` tokens
(ignore_eos), and reports output tokens / wall time plus the async scheduling
counters from ``/metrics``. Workers split the machine's cores
(``VLLM_CPU_OMP_THREADS_BIND``; round-robin when there are fewer cores than
ranks), so on a 2-core machine TP=4 measures the cost of the extra ranks, not
a speed-up.
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import openai

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.checkpoint import ensure_checkpoint
from vllm_neuron_sched.testing.server import SERVED_MODEL, OpenAIServer, engine_args

ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "seed": 0,
}


async def measure(url: str, num_requests: int, max_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    prompts = [f"the request {i} token step batch" for i in range(num_requests)]

    async def one(prompt: str) -> int:
        response = await client.completions.create(
            model=SERVED_MODEL,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    checkpoint = ensure_checkpoint()
    logs = Path(tempfile.mkdtemp(prefix="serve_tp_"))
    results = {}
    for tp in args.tp:
        server_args = [
            "--tensor-parallel-size", str(tp), "--max-num-seqs", str(args.requests),
            *engine_args(ENGINE),
        ]  # fmt: skip
        env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(tp)}
        log = logs / f"tp{tp}.log"
        with OpenAIServer.start(checkpoint, server_args, log, env) as server:
            url = server.url
            tokens_per_s = asyncio.run(measure(url, args.requests, args.max_tokens))
            results[tp] = tokens_per_s
            counters = {
                name.removeprefix("vllm:neuron_sched_"): value
                for name, value in server.metrics().items()
                if name.startswith("vllm:neuron_sched_") and name.endswith("_total")
            }
            print(f"TP={tp}: {tokens_per_s:.1f} output tok/s  {counters}")
    if 1 in results:
        for tp, value in results.items():
            print(f"TP={tp} / TP=1: {value / results[1]:.2f}")
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
