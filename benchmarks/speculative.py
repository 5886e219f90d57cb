"""Speculative decoding: output tokens/s with and without it, stock and ours.

    python -m benchmarks.speculative --out /tmp/bench_spec [--repeats 3]

Each mode runs in its own process (vLLM picks its platform once per process):
stock vLLM with and without n-gram drafts, ours sync and async with and
without them. The default model is SmolLM2-135M-Instruct
(``testing/real_model.py``) on copy-heavy chat prompts (copy a table, fix the
typos in a paragraph, list a log's WARN lines, continue a numbered list,
rename a function, repeat a sentence, reformat JSON, repeat a passage): each
answer copies long runs from its prompt, the n-gram proposer's case; greedy,
EOS on, 96 tokens at most. A closed-loop client keeps ``--concurrency``
requests in flight through the engine's own step loop; one warm-up pass, then
``--repeats`` timed passes; medians are reported with vLLM's acceptance
counters and the ratio to stock's synchronous n-gram.

``--model repeat`` runs the trained repeat checkpoint (``testing/checkpoint.py``)
instead, whose greedy output continues a token cycle, with its trained draft
model (``*_draft`` modes, right on every other cycle).
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
from vllm_neuron_sched.testing.real_model import PASSAGE

RESULT = "SPEC_BENCH_RESULT:"
# The trained draft: right on every other token cycle, wrong on the rest.
DRAFT = {"method": "draft_model", "model": str(DRAFT_CHECKPOINT)}
ENGINE = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 256,
    "seed": 0,
    "enable_prefix_caching": False,
    "enforce_eager": True,
    "disable_log_stats": False,
}
STOCK = {"VLLM_NEURON_SCHED_DISABLE": "1"}
COMPILED = {"VLLM_NEURON_SCHED_DEVICE": "compiled"}
COMPILE = {"enforce_eager": False}  # over ENGINE's eager
# name -> (engine keywords, environment, speculative config's method or None)
MODES: dict[str, tuple[dict[str, Any], dict[str, str], str | None]] = {
    "stock_sync": ({"async_scheduling": False}, STOCK, None),
    "stock_sync_ngram": ({"async_scheduling": False}, STOCK, "ngram"),
    "ours_sync": ({"async_scheduling": False}, {}, None),
    "ours_async": ({"async_scheduling": True}, {}, None),
    "ours_sync_ngram": ({"async_scheduling": False}, {}, "ngram"),
    # vLLM takes n-gram drafts under async scheduling as ngram_gpu only.
    "ours_async_ngram": ({"async_scheduling": True}, {}, "ngram_gpu"),
    "ours_sync_draft": ({"async_scheduling": False}, {}, "draft_model"),
    # Compiled forwards: stock's default (one graph, dynamic token count) and
    # our compiled device (one graph per declared shape, at start-up).
    "stock_sync_compiled": ({"async_scheduling": False, **COMPILE}, STOCK, None),
    "stock_sync_ngram_compiled": (
        {"async_scheduling": False, **COMPILE},
        STOCK,
        "ngram",
    ),
    "ours_sync_compiled": ({"async_scheduling": False, **COMPILE}, COMPILED, None),
    "ours_async_compiled": ({"async_scheduling": True, **COMPILE}, COMPILED, None),
    "ours_async_ngram_compiled": (
        {"async_scheduling": True, **COMPILE},
        COMPILED,
        "ngram_gpu",
    ),
}
BASELINE = "stock_sync_ngram"  # what the ratios are taken against


# ``--penalties``: what a chat client commonly sets against repetition.
PENALTIES = {
    "repetition_penalty": 1.1,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.2,
}


def speculative_config(method: str | None, k: int) -> dict[str, Any] | None:
    if method is None:
        return None
    if method == "draft_model":
        return {**DRAFT, "num_speculative_tokens": k}
    return {
        "method": method,
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


# Copy-heavy work a user gives a small instruction model: each answer copies
# long runs from its prompt, the n-gram proposer's case. (instruction, text)
COPY_TASKS = (
    (
        "Copy this table exactly, then add a row for Oslo.",
        "| city | country | population |\n| --- | --- | --- |\n"
        "| Lisbon | Portugal | 545,000 |\n| Madrid | Spain | 3,332,000 |\n"
        "| Paris | France | 2,102,000 |\n| Vienna | Austria | 1,982,000 |\n"
        "| Prague | Czechia | 1,357,000 |\n| Dublin | Ireland | 592,000 |",
    ),
    (
        "Fix the typos in this paragraph and write it out again in full.",
        "The comittee met on tuesday to discus the new libary. Every member "
        "agreed that the bulding needs more light and a quieter reading room. "
        "The architect will present two designs next month, and the town will "
        "vote on the one it prefers before the end of the yeer.",
    ),
    (
        "List every WARN line of this log, exactly as written.",
        "08:00:01 INFO server started on port 8080\n"
        "08:00:05 WARN disk /data is 91% full\n"
        "08:01:12 INFO request GET /health 200\n"
        "08:02:40 WARN slow query on table orders took 2.4 s\n"
        "08:03:02 INFO request POST /orders 201\n"
        "08:04:17 WARN retrying connection to cache host cache-2\n"
        "08:05:00 INFO request GET /orders/17 200\n"
        "08:06:33 WARN certificate for api.example.com expires in 9 days",
    ),
    (
        "Continue this numbered list up to item 12, in the same format.",
        "1. Check the tyre pressure.\n2. Check the oil level.\n"
        "3. Check the brake fluid.\n4. Check the coolant level.\n"
        "5. Check the windscreen washer fluid.\n6. Check the lights.",
    ),
    (
        "Rename the function load_items to read_records everywhere in this "
        "code and show the whole code.",
        "def load_items(path):\n    with open(path) as f:\n"
        "        return [line.strip() for line in f]\n\n\n"
        "def count_items(path):\n    return len(load_items(path))\n\n\n"
        "def first_item(path):\n    items = load_items(path)\n"
        "    return items[0] if items else None",
    ),
    (
        "Repeat this sentence three times.",
        "The quick brown fox jumps over the lazy dog near the river bank.",
    ),
    (
        "Rewrite this JSON with one key per line, keeping every value.",
        '{"id": 4021, "name": "Ada Lovelace", "role": "engineer", "team": '
        '"compilers", "office": "Berlin", "languages": ["Python", "C++", "Rust"], '
        '"active": true}',
    ),
    ("Repeat the text exactly.", PASSAGE),
)


def copy_prompts(checkpoint: str, count: int) -> list[str]:
    """``count`` chat prompts: the tasks in turn (the same prompt twice gives
    the same answer; requests differ by position in the run)."""
    from transformers import AutoTokenizer

    from vllm_neuron_sched.testing.real_model import chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [
        chat_prompt(tokenizer, f"{task}\n\n{text}")
        for task, text in (COPY_TASKS[i % len(COPY_TASKS)] for i in range(count))
    ]


def workload(name: str, checkpoint: str, concurrency: int) -> tuple[list, list[int]]:
    """Prompts (text or token ids) and their output budgets."""
    if name == "copy":
        # Enough requests that a closed loop refills the batch.
        count = max(4, concurrency * 3 // 2)
        return copy_prompts(checkpoint, count), [96] * count
    from vllm_neuron_sched.testing.checkpoint import repeat_prompt_ids

    count = max(8, concurrency * 3 // 2)
    prompts = [repeat_prompt_ids(checkpoint, seed, length=32) for seed in range(count)]
    return prompts, [256] * count


def closed_loop(
    llm: Any,
    inputs: list,
    params: list,
    concurrency: int,
    tag: str,
    adapters: list | None = None,
) -> tuple[float, list[list[int]]]:
    """A client that keeps ``concurrency`` requests in flight (a finished one
    is replaced by the next), through the engine's own step loop: the wall
    time and each request's output tokens. ``adapters``: each request's
    ``LoRARequest`` or None."""
    engine = llm.llm_engine
    adapters = adapters or [None] * len(inputs)
    pending = list(enumerate(zip(inputs, params)))
    outputs: dict[int, list[int]] = {}
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            index, (prompt, sampling) = pending.pop(0)
            engine.add_request(
                f"{tag}-{index}", prompt, sampling, lora_request=adapters[index]
            )
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.rsplit("-", 1)[1])] = list(
                    out.outputs[0].token_ids
                )
                in_flight -= 1
    return time.perf_counter() - start, [outputs[i] for i in range(len(inputs))]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from vllm_neuron_sched.testing.oracle import counted_since, spec_decode_counters

    kwargs, _, method = MODES[spec["mode"]]
    concurrencies = spec["concurrencies"]
    start = time.perf_counter()
    llm = LLM(
        model=spec["checkpoint"],
        dtype=spec["dtype"],
        max_num_seqs=max(concurrencies),
        speculative_config=speculative_config(method, spec["k"]),
        **{**ENGINE, **kwargs},
    )
    start_s = time.perf_counter() - start

    def stats() -> dict[str, int] | None:
        try:
            return llm.collective_rpc("get_async_scheduling_stats")[0]
        except Exception:
            return None  # stock vLLM

    # Real text ends on EOS; the trained cycles have none worth ending on.
    ignore_eos = spec["workload"] != "copy"
    results = {}
    for run_index, concurrency in enumerate(concurrencies):
        prompts, budgets = workload(spec["workload"], spec["checkpoint"], concurrency)
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                ignore_eos=ignore_eos,
                **(PENALTIES if spec["penalties"] else {}),
            )
            for n in budgets
        ]
        closed_loop(llm, inputs, params, concurrency, f"w{run_index}")  # warm-up
        before, counters_before = stats(), spec_decode_counters(llm)
        walls = []
        for repeat in range(spec["repeats"]):
            tag = f"c{run_index}r{repeat}"
            wall, tokens = closed_loop(llm, inputs, params, concurrency, tag)
            walls.append(wall)
        after = stats()
        results[str(concurrency)] = {
            "walls": walls,
            "num_tokens": sum(map(len, tokens)),
            "tokens": tokens,
            "counters": counted_since(counters_before, spec_decode_counters(llm)),
            "start_s": start_s,
            "steps": None
            if before is None or after is None
            else {key: after[key] - before[key] for key in after},
        }
    return results


def run(mode: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = {
        "mode": mode,
        "dtype": dtype,
        "workload": args.workload,
        "checkpoint": args.checkpoint,
        "repeats": args.repeats,
        "concurrencies": args.concurrency,
        "k": args.k,
        "penalties": args.penalties,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **MODES[mode][1]}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return run_json_child(
        ["-m", "benchmarks.speculative", "--child"], spec, env, RESULT, 3600
    )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    wall = statistics.median(result["walls"])
    counters = result["counters"]
    drafts = counters.get("num_draft_tokens", 0)
    per_pos = counters.get("num_accepted_tokens_per_pos") or []
    num_drafts = counters.get("num_drafts", 0)
    return {
        "tok_s": result["num_tokens"] / wall,
        "acceptance": round(counters.get("num_accepted_tokens", 0) / drafts, 3)
        if drafts
        else None,
        "draft_tokens": drafts or None,
        "per_position": [round(n / num_drafts, 3) for n in per_pos]
        if num_drafts
        else None,
        "steps": result["steps"],
        "start_s": round(result["start_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_spec"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=None, help="default: per model")
    parser.add_argument("--model", choices=("repeat", "real"), default="real")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--concurrency", default="1,4,16", help="requests in flight, comma-separated"
    )
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="every request with the three penalties (PENALTIES)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(json.loads(sys.stdin.read()))), flush=True)
        return
    from vllm_neuron_sched.testing.checkpoint import ensure_trained_checkpoints
    from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint

    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model == "real":
        args.checkpoint = str(ensure_real_checkpoint())
        args.workload = "copy"
        # There is no draft model for it.
        modes = [m for m in MODES if not m.endswith(("_draft", "_compiled"))]
    else:
        args.checkpoint = str(ensure_trained_checkpoints()[0])
        args.workload = "decode_heavy"
        modes = [m for m in MODES if not m.endswith("_compiled")]
    modes = args.modes.split(",") if args.modes else modes
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    table: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes.split(","):
        for mode in modes:
            raw = run(mode, dtype, args)
            for concurrency, result in raw.items():
                table[f"{dtype}/{concurrency}/{mode}"] = {
                    "raw": result,
                    **summarize(result),
                }
    print(f"load average at end: {os.getloadavg()}", flush=True)
    for key, row in table.items():
        dtype, concurrency, mode = key.split("/")
        base = table.get(f"{dtype}/{concurrency}/{BASELINE}")
        # Tokens against stock_sync's, or the first stock mode run.
        stocks = [m for m in ["stock_sync", *modes] if m.startswith("stock_")]
        reference = next(
            (m for m in stocks if f"{dtype}/{concurrency}/{m}" in table), None
        )
        ratio = row["tok_s"] / base["tok_s"] if base else float("nan")
        same = (
            ""
            if reference is None
            else row["raw"]["tokens"]
            == table[f"{dtype}/{concurrency}/{reference}"]["raw"]["tokens"]
        )
        print(
            f"{dtype:9s} c={concurrency:3s} {mode:18s} {row['tok_s']:7.1f} tok/s "
            f"x{ratio:5.2f} of {BASELINE}  acceptance {row['acceptance']} "
            f"(drafted {row['draft_tokens']})  = {reference} tokens: {same}  "
            f"start {row['start_s']} s"
        )
    report = {
        "command": " ".join(["python -m benchmarks.speculative", *sys.argv[1:]]),
        "model": args.checkpoint,
        "results": table,
    }
    (args.out / "speculative.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
