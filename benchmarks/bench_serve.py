"""vLLM's own serving client against stock vLLM, our sync and our async
servers, side by side: ``python -m benchmarks.bench_serve``.

Per mode: starts the OpenAI server on the embedded tiny checkpoint, or with
``--model real`` on SmolLM2-135M-Instruct (``testing/real_model.py``)
(default compilation, a free loopback port), then runs

    vllm-neuron-sched bench serve --backend vllm --dataset-name random \\
        --random-input-len 48 --random-output-len 64 --num-prompts 64 \\
        --max-concurrency 16 --ignore-eos --seed R

``--repeats`` times (one warm-up run first, not counted) and reports the
median output tokens/s, TPOT and TTFT from the client's own result JSON.
Modes:

- ``stock``: stock vLLM CPU (``VLLM_NEURON_SCHED_DISABLE=1``), sync as it
  ships;
- ``stock_async``: vLLM's CPU worker behind our platform, async on;
- ``sync`` / ``async``: our scheduler and worker, async off / on.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_neuron_sched.testing.checkpoint import ensure_checkpoint
from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint
from vllm_neuron_sched.testing.server import SERVED_MODEL, OpenAIServer

MODES = ("stock", "stock_async", "sync", "async")
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
MODE_ARGS = {
    "stock": [],
    "stock_async": [
        "--async-scheduling",
        "--worker-cls",
        "vllm.v1.worker.cpu_worker.CPUWorker",
    ],
    "sync": ["--no-async-scheduling"],
    "async": ["--async-scheduling"],
}
FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms")


def client_command(url: str, checkpoint: Path, args: Any, seed: int, out: Path):
    return [
        sys.executable, "-m", "vllm_neuron_sched.cli", "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", SERVED_MODEL,
        "--tokenizer", str(checkpoint), "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos",
        "--seed", str(seed), "--disable-tqdm", "--save-result",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def run_mode(mode: str, checkpoint: Path, args: Any, logs: Path) -> dict[str, Any]:
    env = {"VLLM_NEURON_SCHED_DISABLE": "1" if mode == "stock" else "0"}
    server_args = [
        *SERVER_ARGS,
        "--max-num-seqs",
        str(args.concurrency),
        *MODE_ARGS[mode],
    ]
    runs = []
    with OpenAIServer.start(checkpoint, server_args, logs / f"{mode}.log", env) as srv:
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            out = logs / f"{mode}_{repeat}.json"
            command = client_command(srv.url, checkpoint, args, repeat, out)
            with (logs / f"{mode}_client.log").open("a") as log:
                subprocess.run(
                    command, check=True, stdout=log, stderr=subprocess.STDOUT
                )
            if repeat:
                result = json.loads(out.read_text())
                runs.append({key: result[key] for key in (*FIGURES, "completed")})
    return {
        "repeats": runs,
        **{key: statistics.median(r[key] for r in runs) for key in FIGURES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/bench_serve.json")
    )
    args = parser.parse_args()

    real = args.model == "real"
    checkpoint = ensure_real_checkpoint() if real else ensure_checkpoint()
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    load_start = os.getloadavg()
    results = {}
    for mode in args.modes.split(","):
        started = time.monotonic()
        results[mode] = run_mode(mode, checkpoint, args, logs)
        print(
            f"{mode:12s} {results[mode]['output_throughput']:8.0f} output tok/s  "
            f"TPOT {results[mode]['median_tpot_ms']:6.2f} ms  "
            f"TTFT {results[mode]['median_ttft_ms']:7.1f} ms  "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    ratios = {}
    if "async" in results:
        for other in results:
            if other != "async":
                ratios[f"async_over_{other}"] = [
                    a["output_throughput"] / b["output_throughput"]
                    for a, b in zip(
                        results["async"]["repeats"], results[other]["repeats"]
                    )
                ]
                median = statistics.median(ratios[f"async_over_{other}"])
                print(f"async over {other}: {median:.2f}")
    report = {
        "command": " ".join(["python -m benchmarks.bench_serve", *sys.argv[1:]]),
        "model": str(checkpoint),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "results": results,
        "ratios": ratios,
        "logs": str(logs),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"report: {args.json}; logs: {logs}")


if __name__ == "__main__":
    main()
