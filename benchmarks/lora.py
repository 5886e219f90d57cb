"""What a LoRA adapter costs a step: output tokens/s without LoRA, with LoRA
on but no adapter in use, one adapter for every request, four adapters in one
batch; stock vLLM CPU and ours (async).

    python -m benchmarks.lora --out /tmp/bench_lora [--repeats 3]

SmolLM2-135M-Instruct (``testing/real_model.py``) on the copy-heavy chat
prompts of ``benchmarks.speculative``, greedy, 64 tokens, a closed-loop client
at ``--concurrency`` requests; four random rank-8 adapters of its attention
and MLP projections (``make_lora_adapter``). Each engine runs in its own
process; one warm-up pass per scenario (it also loads the adapters), then
``--repeats`` timed passes, medians reported. Stock's tokens are checked
against ours where stock is right: its CPU kernels give a request without an
adapter the last slot's adapter once one is loaded (docs/design.md section
15), so its "no adapter" pass runs first, before any is.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import speculative
from benchmarks.speculative import closed_loop, copy_prompts
from vllm_neuron_sched.testing.oracle import run_json_child

RESULT = "LORA_BENCH_RESULT:"
# Eager, no prefix cache; vLLM's stats logging off (its default).
ENGINE = {
    **{k: v for k, v in speculative.ENGINE.items() if k != "disable_log_stats"},
    "async_scheduling": True,
}
LORA = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}
STOCK = speculative.STOCK
# name -> (engine keywords, environment)
ENGINES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "stock": ({}, STOCK),
    "ours": ({}, {}),
    "stock_lora": (LORA, STOCK),
    "ours_lora": (LORA, {}),
}
# Scenario -> adapters (by index, None: the base model) of the requests in turn.
SCENARIOS: dict[str, list[int | None]] = {
    "no adapter": [None],
    "one adapter": [0],
    "four adapters": [0, 1, 2, 3],
}
NUM_ADAPTERS = 4
MAX_TOKENS = 64


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kwargs, _ = ENGINES[spec["engine"]]
    concurrency = spec["concurrency"]
    llm = LLM(
        model=spec["checkpoint"],
        dtype=spec["dtype"],
        max_num_seqs=concurrency,
        **{**ENGINE, **kwargs},
    )
    count = max(4, concurrency * 3 // 2)
    prompts = copy_prompts(spec["checkpoint"], count)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for _ in prompts
    ]
    adapters = [
        LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])
    ]
    scenarios = SCENARIOS if kwargs else {"no adapter": SCENARIOS["no adapter"]}
    results = {}
    for name, pattern in scenarios.items():
        uses = [pattern[i % len(pattern)] for i in range(len(prompts))]
        requests = [None if use is None else adapters[use] for use in uses]
        walls, tokens = [], []
        for repeat in range(1 + spec["repeats"]):  # the first warms up
            wall, tokens = closed_loop(
                llm, prompts, params, concurrency, f"{name}{repeat}", requests
            )
            walls.append(wall)
        results[name] = {
            "walls": walls[1:],
            "num_tokens": sum(map(len, tokens)),
            "tokens": tokens,
        }
    return results


def run(engine: str, args: argparse.Namespace, adapters: list[str]) -> dict:
    spec = {
        "engine": engine,
        "dtype": args.dtype,
        "checkpoint": args.checkpoint,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "adapters": adapters,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **ENGINES[engine][1]}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return run_json_child(["-m", "benchmarks.lora", "--child"], spec, env, RESULT, 3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_lora"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(json.loads(sys.stdin.read()))), flush=True)
        return
    from vllm_neuron_sched.testing.checkpoint import make_lora_adapter
    from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint

    args.checkpoint = str(ensure_real_checkpoint())
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = [
        str(make_lora_adapter(args.checkpoint, args.out / f"a{i}", seed=i, scale=0.02))
        for i in range(NUM_ADAPTERS)
    ]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    raw = {engine: run(engine, args, adapters) for engine in ENGINES}
    (args.out / "raw.json").write_text(json.dumps(raw))
    rows = []
    for impl in ("stock", "ours"):
        base = raw[impl]["no adapter"]
        for name, result in [("LoRA off", base), *raw[f"{impl}_lora"].items()]:
            tok_s = result["num_tokens"] / statistics.median(result["walls"])
            rows.append((impl, name, tok_s, result["tokens"]))
    base_tok_s = {impl: tok_s for impl, name, tok_s, _ in rows if name == "LoRA off"}
    stock_tokens = {name: tokens for impl, name, _, tokens in rows if impl == "stock"}
    header = f"{'engine':6} {'scenario':14} {'tok/s':>7} {'vs LoRA off':>11}"
    print(f"\n{header} stock's tokens")
    for impl, name, tok_s, tokens in rows:
        same = "" if impl == "stock" else str(tokens == stock_tokens[name])
        print(
            f"{impl:6} {name:14} {tok_s:7.1f} {tok_s / base_tok_s[impl]:11.2f} {same}"
        )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
