"""Pipeline parallel: our async against our sync, whole runs, per stage count.

    python -m benchmarks.pipeline [--stages 2 4] [--sim-ms 0 20] [--repeats 3]

Per stage count and simulated device latency, one engine per mode (the
tiny four-layer checkpoint, one layer or two per stage, ``LLM`` with vLLM's
multiprocessing executor, ranks bound round-robin to the machine's cores),
then the decode-heavy and burst workloads (``configs.py``'s shapes, scaled
down). Each engine runs every repeat of its workloads (a sync and an async
engine cannot alternate without restarting); the median of the repeats is
reported. Tokens
per second count output tokens over the whole run; TPOT is the run's wall
time per output token of one request (every request of a workload runs in
one batch). ``--sim-ms`` sets the simulated device latency per execution
(``set_sim_device_ms``): on two cores the stages' forwards compete for the
same cores, and the latency shows what overlap async buys where a device
would run them. The load average is printed before each engine.
"""

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

WORKLOADS = {
    # (requests, prompt lengths, output tokens)
    "decode_heavy": (16, (32, 32), 64),
    "burst": (16, (16, 128), 32),
}


def _prompts(num: int, lengths: tuple[int, int], seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [
                rng.randrange(10, 900) for _ in range(rng.randint(*lengths))
            ]
        }
        for _ in range(num)
    ]


def run_engine(
    model: str, stages: int, is_async: bool, sim_ms: float, repeats: int
) -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_neuron_sched.binding import thread_binding
    from vllm_neuron_sched.testing.in_process import in_process_llm

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(stages)
    results: dict[str, Any] = {}
    with in_process_llm(
        model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
        pipeline_parallel_size=stages,
        distributed_executor_backend="mp",
        async_scheduling=is_async,
    ) as llm:
        llm.collective_rpc("set_sim_device_ms", args=(float(sim_ms),))
        for name, (num, lengths, max_tokens) in WORKLOADS.items():
            prompts = _prompts(num, lengths)
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            )
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm up
            runs = []
            for _ in range(repeats):
                llm.reset_prefix_cache()
                before = llm.collective_rpc("get_async_scheduling_stats")[0]
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                after = llm.collective_rpc("get_async_scheduling_stats")[0]
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                runs.append(
                    {
                        "tok_s": tokens / wall,
                        "tpot_ms": 1000 * wall / max_tokens,
                        "host_waits": after["host_waits"] - before["host_waits"],
                        "async_steps": after["async_steps"] - before["async_steps"],
                    }
                )
            results[name] = {
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                "host_waits": max(r["host_waits"] for r in runs),
                "async_steps": min(r["async_steps"] for r in runs),
                "runs": runs,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sim-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm_neuron_sched.testing.checkpoint import (
        DEFAULT_CHECKPOINT,
        CheckpointSpec,
        ensure_checkpoint,
    )

    model = str(
        ensure_checkpoint(
            DEFAULT_CHECKPOINT.parent / "tiny-llama-4-layers", CheckpointSpec(layers=4)
        )
    )
    report: list[dict[str, Any]] = []
    for stages in args.stages:
        for sim_ms in args.sim_ms:
            row: dict[str, Any] = {"stages": stages, "sim_ms": sim_ms}
            for mode in ("sync", "async"):
                load = os.getloadavg()[0]
                print(
                    f"PP={stages} sim={sim_ms} ms {mode}: load {load:.2f}", flush=True
                )
                row[mode] = run_engine(
                    model, stages, mode == "async", sim_ms, args.repeats
                )
            report.append(row)
            for name in WORKLOADS:
                sync, async_ = row["sync"][name], row["async"][name]
                ratio = async_["tok_s"] / sync["tok_s"]
                print(
                    f"PP={stages} sim={sim_ms:g} ms {name}: "
                    f"tok/s sync {sync['tok_s']:.1f} async {async_['tok_s']:.1f} "
                    f"(x{ratio:.2f}); TPOT ms sync {sync['tpot_ms']:.1f} "
                    f"async {async_['tpot_ms']:.1f}; async host waits "
                    f"{async_['host_waits']}, async steps {async_['async_steps']}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
