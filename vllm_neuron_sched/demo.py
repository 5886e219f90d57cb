"""The main job on the embedded default: the same requests with async
scheduling off, then on, and what it buys.

    python -m vllm_neuron_sched.demo [--sync | --async] [--tp N]
                                     [--requests N] [--max-tokens N]

Makes the tiny checkpoint once (random weights, cached under
``~/.cache/vllm_neuron_sched``), runs ``LLM.generate`` through our platform in
one process per mode (engine logs go to a file, the table says where) and
prints output tokens/s, time per output token (wall time over the longest
output), the speed-up, the async flow's counters and the dead tokens, with
the load average (figures from a busy machine are not comparable). Half of
the requests run greedy to ``max_tokens``; the other half sample until one
of a few stop tokens, the way requests end on EOS, so run-ahead leaves dead
tokens.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_neuron_sched import envs
from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.diagnostics import error_lines
from vllm_neuron_sched.testing.checkpoint import ensure_checkpoint

_RESULT = "DEMO_RESULT:"


def _run_mode(is_async: bool, tp: int, num_requests: int, max_tokens: int) -> dict:
    """One engine, in this process: generate, time it, read the counters."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(ensure_checkpoint()),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=num_requests,
        tensor_parallel_size=tp,
        async_scheduling=is_async,
        seed=0,
    )
    prompts = [f"the request {i} token step batch" for i in range(num_requests)]
    stop_ids = list(range(40, 56))
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, stop_token_ids=stop_ids
        )
        for i in range(num_requests)
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    before = llm.collective_rpc("get_async_scheduling_stats")[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.collective_rpc("get_async_scheduling_stats")[0]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Every request gets a token per step: wall time over the longest output.
    num_steps = max(len(o.outputs[0].token_ids) for o in outputs)
    counters = {key: after[key] - before[key] for key in after}
    return {
        "tokens": num_tokens,
        "tok_s": num_tokens / elapsed,
        "tpot_ms": 1e3 * elapsed / max(num_steps, 1),
        "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "first_completion": outputs[0].outputs[0].text,
        **counters,
    }


def _spawn(mode: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """A mode in its own process, its engine logs into ``log``."""
    command = [
        sys.executable, "-m", "vllm_neuron_sched.demo", "--child", mode,
        "--tp", str(args.tp), "--requests", str(args.requests),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=out, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    cause = error_lines(log.read_text() + proc.stdout, max_chars=2000)
    raise SystemExit(
        f"the {mode} run failed (exit {proc.returncode}):\n{cause}\n(whole log: {log})"
    )


_LEGEND = """\
async: steps whose decode rows took their input ids from the device token table,
  with no host wait; fallback: steps whose host needed a device result before the
  engine had read it (every step in sync mode, prompt chunks included); prefill:
  prompt-chunk steps; host waits: such reads, in steps or not."""


def _table(results: dict[str, dict[str, Any]], log_dir: Path) -> str:
    rows = [
        (
            "mode",
            "tok/s",
            "TPOT ms",
            "async",
            "fallback",
            "prefill",
            "host waits",
            "dead tokens",
        ),
    ]
    for mode, r in results.items():
        rows.append(
            (
                mode,
                f"{r['tok_s']:.0f}",
                f"{r['tpot_ms']:.2f}",
                str(r["async_steps"]),
                str(r["sync_fallback_steps"]),
                str(r["prefill_steps"]),
                str(r["host_waits"]),
                f"{r['dead_tokens']} ({r['stopped']} stopped)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    if {"sync", "async"} <= results.keys():
        speedup = results["async"]["tok_s"] / results["sync"]["tok_s"]
        lines.append(f"async over sync: {speedup:.2f}x output tokens/s")
    lines.append(_LEGEND)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(
        f"load average {load} (1, 5, 15 min) on {os.cpu_count()} cores: figures "
        "from a machine busy with other work are not comparable"
    )
    lines.append(f"engine logs: {log_dir}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--sync", action="store_true", help="only async off")
    modes.add_argument("--async", dest="async_", action="store_true", help="only on")
    modes.add_argument("--child", choices=("sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    try:
        envs.check_values()  # a malformed value fails here, not in a child
    except ValueError as error:
        raise SystemExit(f"vllm_neuron_sched.demo: {error}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", thread_binding(args.tp))
    if args.child:
        is_async = args.child == "async"
        result = _run_mode(is_async, args.tp, args.requests, args.max_tokens)
        print(_RESULT + json.dumps(result), flush=True)
        return

    ensure_checkpoint()
    log_dir = Path(tempfile.mkdtemp(prefix="vllm_neuron_sched_demo_"))
    selected = ["sync", "async"]
    if args.sync or args.async_:
        selected = ["sync"] if args.sync else ["async"]
    results = {}
    for mode in selected:
        print(f"running {mode} ...", flush=True)
        results[mode] = _spawn(mode, args, log_dir / f"{mode}.log")
    print(f"first completion: {results[selected[-1]]['first_completion']!r}")
    print(_table(results, log_dir))


if __name__ == "__main__":
    main()
