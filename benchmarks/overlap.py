"""What the run-ahead buys on a device that holds its own compute: our async
over our sync, at a simulated device latency, with the step timeline that says
where the host and the device wait on each other.

    python -m benchmarks.overlap [--sim-ms 1 5 10] [--repeats 5] [--enforce-eager]

Each run is a fresh engine in its own process (``benchmarks.child``) on the
tiny Llama checkpoint, with the threaded device and
``VLLM_NEURON_SCHED_SIM_DEVICE_MS`` (each device execution holds the device
that much longer without a core, as an accelerator's compute would); sync and
async alternate, repeat after repeat, the first of each pair rotating. Two
workloads per run: ``steady`` (16 requests x 96 tokens, all decoding from the
start) and ``churn`` (48 requests of 16 to 128 prompt tokens and 16 to 96
output tokens arriving within about a second, 16 at a time: requests join and
leave the batch at most steps). Reported per latency: the median of the
paired async / sync output-token ratios, and from a traced run of each mode
the steady steps' period, device time (T_dev, sync), host time (T_cpu = sync
period - T_dev) and the overlap efficiency (async period / max(T_cpu, T_dev):
1.0 is the limit of overlapping host and device).
"""

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.analysis import step_figures
from benchmarks.child import RESULT_MARKER
from vllm_neuron_sched.testing.checkpoint import DEFAULT_CHECKPOINT, ensure_checkpoint
from vllm_neuron_sched.testing.oracle import run_json_child

STEADY = {
    "name": "steady",
    "kind": "batch",
    "num_requests": 16,
    "prompt_len": 16,
    "max_tokens": 96,
    "repeats": 1,
    "trace": True,
}
CHURN = {
    "name": "churn",
    "kind": "mixed",
    "num_requests": 48,
    "prompt_len_range": [16, 128],
    "max_tokens_range": [16, 96],
    "arrival_rate": 48.0,
    "repeats": 1,
    "trace": False,
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "seed": 0,
}


def run_child(mode: str, sim_ms: float, model: str, eager: bool) -> dict[str, Any]:
    spec = {
        "model": model,
        "engine_kwargs": {
            **ENGINE,
            "async_scheduling": mode == "async",
            "enforce_eager": eager,
        },
        "workloads": [STEADY, CHURN],
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NEURON_SCHED_DEVICE": "thread",
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS": str(sim_ms),
    }
    return run_json_child(["-m", "benchmarks.child"], spec, env, RESULT_MARKER, 900)


def point(sim_ms: float, repeats: int, model: str, eager: bool) -> dict[str, Any]:
    """Alternated runs at one latency: ratios per workload, the timeline's
    figures per mode (each repeat's traced steady run)."""
    tok_s: dict[str, dict[str, list[float]]] = {"sync": {}, "async": {}}
    steps: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for r in range(repeats):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for mode in order:
            result = run_child(mode, sim_ms, model, eager)
            for name, figures in result["workloads"].items():
                run = figures["repeats"][0]
                tok_s[mode].setdefault(name, []).append(run["output_tok_s"])
                if name == "steady" and run.get("steady_tok_s"):
                    tok_s[mode].setdefault("steady_decode", []).append(
                        run["steady_tok_s"]
                    )
                if figures.get("timeline"):
                    steps[mode].append(
                        step_figures(figures["timeline"], STEADY["num_requests"])
                    )
    report: dict[str, Any] = {"sim_ms": sim_ms, "loadavg_end": os.getloadavg()}
    for name in tok_s["sync"]:
        ratios = [a / s for a, s in zip(tok_s["async"][name], tok_s["sync"][name])]
        report[f"{name}_async_over_sync"] = statistics.median(ratios)
        report[f"{name}_ratios"] = [round(x, 3) for x in ratios]
    report.update(_overlap(steps["sync"], steps["async"]))
    return report


def _overlap(
    sync: list[dict[str, Any]], asynchronous: list[dict[str, Any]]
) -> dict[str, Any]:
    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows if r.get(key) is not None)

    t_dev, sync_step = med(sync, "t_dev_s"), med(sync, "step_s")
    t_cpu = sync_step - t_dev
    async_step = med(asynchronous, "step_s")
    ms = {
        "sync_step_ms": sync_step,
        "async_step_ms": async_step,
        "t_dev_ms": t_dev,
        "t_cpu_ms": t_cpu,
        "async_t_dev_ms": med(asynchronous, "t_dev_s"),
        "sync_worker_host_ms": med(sync, "t_host_worker_s"),
        "async_worker_host_ms": med(asynchronous, "t_host_worker_s"),
        "async_output_thread_ms": med(asynchronous, "t_output_thread_s"),
    }
    return {
        **{k: round(v * 1e3, 3) for k, v in ms.items()},
        "limit_async_over_sync": round(sync_step / max(t_cpu, t_dev), 3),
        "overlap_efficiency": round(async_step / max(t_cpu, t_dev), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-ms", type=float, nargs="+", default=[1, 5, 10])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile (default: vLLM's default compilation)",
    )
    args = parser.parse_args()
    model = str(ensure_checkpoint(DEFAULT_CHECKPOINT))
    print(f"loadavg at start: {os.getloadavg()}", flush=True)
    reports = []
    for sim_ms in args.sim_ms:
        reports.append(point(sim_ms, args.repeats, model, args.enforce_eager))
        print(json.dumps(reports[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
