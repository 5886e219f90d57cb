"""Speculative decoding: output tokens/s with and without it, stock and ours.

    python -m benchmarks.speculative --out /tmp/bench_spec [--repeats 3]

Each configuration runs in its own process (vLLM picks its platform once per
process) on the trained repeat checkpoint (``testing/checkpoint.py``), whose
greedy output continues a token cycle, so n-gram drafts are accepted where the
history repeats, and with its trained draft model (``*_draft`` modes), which
is right on every other cycle and wrong on the rest. Workloads:
``decode_heavy`` (every prompt a repeat prompt, long outputs) and ``mixed``
(half repeat prompts, half misleading ones whose first drafts are rejected,
shorter outputs). One warm-up run, then ``--repeats`` timed ``LLM.generate``
runs of the whole workload; the medians are reported with vLLM's acceptance
counters and our step counters.

``--model real`` runs SmolLM2-135M-Instruct instead (``testing/real_model.py``)
on one ``copy`` workload: chat prompts that ask to repeat, summarize or
extract from a passage of real text, which a real model answers by copying
from its prompt (the n-gram proposer's case), greedy with EOS on. There is no
draft model for it: the ``*_draft`` modes are left out.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm_neuron_sched.testing.checkpoint import DRAFT_CHECKPOINT
from vllm_neuron_sched.testing.oracle import run_json_child

RESULT = "SPEC_BENCH_RESULT:"
K = 3
NGRAM = {"num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# The trained draft: right on every other token cycle, wrong on the rest.
DRAFT = {
    "method": "draft_model",
    "model": str(DRAFT_CHECKPOINT),
    "num_speculative_tokens": K,
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 128,
    "seed": 0,
    "enable_prefix_caching": False,
    "enforce_eager": True,
    "disable_log_stats": False,
}
# name -> (engine keywords, environment)
MODES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "stock_sync": ({"async_scheduling": False}, {"VLLM_NEURON_SCHED_DISABLE": "1"}),
    "stock_sync_ngram": (
        {"async_scheduling": False, "speculative_config": {"method": "ngram", **NGRAM}},
        {"VLLM_NEURON_SCHED_DISABLE": "1"},
    ),
    "ours_async": ({"async_scheduling": True}, {}),
    "ours_sync_ngram": (
        {"async_scheduling": False, "speculative_config": {"method": "ngram", **NGRAM}},
        {},
    ),
    "ours_async_ngram": (
        {
            "async_scheduling": True,
            "speculative_config": {"method": "ngram_gpu", **NGRAM},
        },
        {},
    ),
    "ours_sync_draft": ({"async_scheduling": False, "speculative_config": DRAFT}, {}),
    "ours_async_draft": ({"async_scheduling": True, "speculative_config": DRAFT}, {}),
}


COPY_TASKS = (
    "Repeat the text exactly.",
    "Summarize the text.",
    "Extract every year and number in the text, with the sentence it is in.",
    "Repeat the last three sentences of the text exactly.",
    "List the people and places in the text, quoting where each is named.",
    "Rewrite the text as a list of short facts.",
    "Repeat the first two sentences of the text exactly.",
    "Quote the sentence about the logbooks, then explain it.",
)


def copy_prompts(checkpoint: str) -> list[str]:
    from transformers import AutoTokenizer

    from vllm_neuron_sched.testing.real_model import PASSAGE, chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [chat_prompt(tokenizer, f"{PASSAGE}\n\n{task}") for task in COPY_TASKS]


def workload(name: str, checkpoint: str) -> tuple[list, list[int]]:
    """Prompts (token ids or text) and their output budgets."""
    from vllm_neuron_sched.testing.checkpoint import repeat_prompt_ids, successor_map

    if name == "copy":
        return copy_prompts(checkpoint), [128] * len(COPY_TASKS)
    repeat = [repeat_prompt_ids(checkpoint, seed, length=32) for seed in range(8)]
    if name == "decode_heavy":
        return repeat, [256] * 8
    succ = successor_map(checkpoint)
    misleading = []
    for seed in range(4):
        a, b = repeat_prompt_ids(checkpoint, 100 + seed, length=2)
        others = [t for t in succ if t not in (succ[b], a, b)][seed * 7 : seed * 7 + 3]
        misleading.append(([a, b, *others] * 6)[:30] + [a, b])
    return repeat[:4] + misleading, [64, 96, 128, 192, 64, 96, 128, 192]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from vllm_neuron_sched.testing.oracle import spec_decode_counters

    kwargs, _ = MODES[spec["mode"]]
    llm = LLM(model=spec["checkpoint"], **ENGINE, **kwargs)
    prompts, budgets = workload(spec["workload"], spec["checkpoint"])
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    # Real text ends on EOS; the trained cycles have none worth ending on.
    ignore_eos = spec["workload"] != "copy"
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
        for n in budgets
    ]

    def stats() -> dict[str, int] | None:
        try:
            return llm.collective_rpc("get_async_scheduling_stats")[0]
        except Exception:
            return None  # stock vLLM

    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    before, counters_before = stats(), spec_decode_counters(llm)
    walls, num_tokens = [], 0
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    after, counters_after = stats(), spec_decode_counters(llm)
    counters = {
        key: (
            [a - b for a, b in zip(value, counters_before.get(key, [0] * len(value)))]
            if isinstance(value, list)
            else value - counters_before.get(key, 0)
        )
        for key, value in counters_after.items()
    }
    steps = None
    if before is not None and after is not None:
        steps = {key: after[key] - before[key] for key in after}
    return {
        "walls": walls,
        "num_tokens": num_tokens,
        "tokens_per_request": max(len(o.outputs[0].token_ids) for o in outs),
        "counters": counters,
        "steps": steps,
    }


def run(mode: str, name: str, checkpoint: str, repeats: int) -> dict[str, Any]:
    spec = {"mode": mode, "workload": name, "checkpoint": checkpoint}
    spec["repeats"] = repeats
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **MODES[mode][1]}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return run_json_child(
        ["-m", "benchmarks.speculative", "--child"], spec, env, RESULT, 1800
    )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    wall = statistics.median(result["walls"])
    counters = result["counters"]
    drafts = counters.get("num_draft_tokens", 0)
    per_pos = counters.get("num_accepted_tokens_per_pos") or []
    num_drafts = counters.get("num_drafts", 0)
    return {
        "tok_s": result["num_tokens"] / wall,
        # All requests decode together: the longest one's wall per token.
        "tpot_ms": 1000 * wall / result["tokens_per_request"],
        "acceptance": counters.get("num_accepted_tokens", 0) / drafts
        if drafts
        else None,
        "per_position": [round(n / num_drafts, 3) for n in per_pos]
        if num_drafts
        else None,
        "steps": result["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_spec"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workloads", default=None, help="default: per model")
    parser.add_argument("--model", choices=("repeat", "real"), default="repeat")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(json.loads(sys.stdin.read()))), flush=True)
        return
    from vllm_neuron_sched.testing.checkpoint import ensure_trained_checkpoints
    from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint

    if args.model == "real":
        checkpoint = str(ensure_real_checkpoint())
        args.workloads = args.workloads or "copy"
        modes = [m for m in args.modes.split(",") if not m.endswith("_draft")]
    else:
        checkpoint = str(ensure_trained_checkpoints()[0])
        args.workloads = args.workloads or "decode_heavy,mixed"
        modes = args.modes.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}")
    table: dict[str, dict[str, Any]] = {}
    for name in args.workloads.split(","):
        for mode in modes:
            raw = run(mode, name, checkpoint, args.repeats)
            table[f"{name}/{mode}"] = {"raw": raw, **summarize(raw)}
            row = table[f"{name}/{mode}"]
            print(
                f"{name:13s} {mode:18s} {row['tok_s']:8.0f} tok/s "
                f"TPOT {row['tpot_ms']:6.2f} ms acceptance {row['acceptance']} "
                f"per position {row['per_position']} steps {row['steps']}",
                flush=True,
            )
    report = {
        "command": " ".join(["python -m benchmarks.speculative", *sys.argv[1:]]),
        "model": checkpoint,
        "loadavg_end": os.getloadavg(),
        "results": table,
    }
    (args.out / "speculative.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
