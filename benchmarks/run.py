"""How much async scheduling buys: ``python -m benchmarks.run [--quick]``.

Each engine configuration runs in its own subprocess (``benchmarks.child``),
one after the other, so they never compete for the cores:

- ``stock``: stock vLLM CPU (``VLLM_NEURON_SCHED_DISABLE=1``), synchronous;
- ``stock_async``: vLLM's own CPU worker behind our platform, async forced on;
- ``sync`` / ``async``: our worker, async scheduling off / on (the default
  device backend); the ``overlap`` sweep runs in engines of its own with a
  device thread (the simulated device needs one).

Writes ``--json`` (default ``benchmarks/results/bench.json``) first, then a
Chrome trace and PNGs of the step timeline under ``--out``. See
benchmarks/README.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.analysis import check_plotting, chrome_trace, plot_timelines
from benchmarks.child import PROGRESS_MARKER, RESULT_MARKER

MODES = ("stock", "stock_async", "sync", "async", "sync_1xchunk", "async_1xchunk")
# Our worker with one request's chunk per prefill step (the anchors' rule,
# and this plugin's before batched prefill): the burst workload only.
ONE_ROW_MODES = ("sync_1xchunk", "async_1xchunk")
MAX_MODEL_LEN = 512
CACHE = Path.home() / ".cache" / "vllm_neuron_sched"
# name -> (checkpoint folder, CheckpointSpec kwargs): the embedded tiny model
# and a larger one (head_dim 64 in both: vLLM's CPU attention needs it).
MODELS: dict[str, tuple[Path, dict[str, int]]] = {
    "small": (CACHE / "tiny-llama", {}),
    "large": (
        CACHE / "bench-llama-4x1024",
        {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048},
    ),
}


def workloads(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Real-model workloads (all modes) and the overlap sweep (ours only)."""
    scale = 2 if quick else 1
    return {
        "steady": {  # a fixed decode batch: our runner against vLLM's
            "kind": "batch",
            "num_requests": 16,
            "prompt_len": 16,
            "max_tokens": 128 // scale,
            "repeats": repeats,
        },
        "decode_heavy": {
            "kind": "batch",
            "num_requests": 64 // scale,
            "prompt_len": 32,
            "max_tokens": 128 // scale,
            "repeats": repeats,
        },
        "burst": {  # a traffic spike: every request at once, then decode
            "kind": "burst",
            "num_requests": 64 // scale,
            "prompt_len_range": [16, 256],
            "max_tokens": 64,
            "repeats": repeats,
        },
        "mixed": {
            "kind": "mixed",
            "num_requests": 64 // scale,
            "prompt_len_range": [16, 256],
            "max_tokens_range": [16, 128 // scale],
            "arrival_rate": 32.0,
            "repeats": repeats,
        },
        "overlap": {
            "kind": "overlap",
            "num_requests": 16 // scale,
            "prompt_len": 16,
            "max_tokens": 128 // scale,
            "sim_ms": [1, 10] if quick else [1, 2, 5, 10],
            "repeats": repeats,
        },
    }


def config_spec(
    model: str, mode: str, group: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine's workloads: ``group`` "main" (everything but the overlap
    sweep) or "overlap" (the sweep alone, ours only, small model)."""
    path, _ = MODELS[model]
    engine_kwargs: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 64,
        "seed": 0,
        "async_scheduling": mode in ("stock_async", "async", "async_1xchunk"),
    }
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    if mode == "stock_async":
        engine_kwargs["worker_cls"] = "vllm.v1.worker.cpu_worker.CPUWorker"
    all_workloads = workloads(args.quick, args.repeats)
    names = [n for n in all_workloads if n in args.workloads]
    if args.quick and model == "large":
        names = [n for n in names if n == "decode_heavy"]
    names = [n for n in names if (n == "overlap") == (group == "overlap")]
    if mode in ONE_ROW_MODES:
        names = [n for n in names if n == "burst"]
    specs = []
    for name in names:
        spec = {"name": name, **all_workloads[name]}
        spec["trace"] = name in ("steady", "decode_heavy") and mode in ("sync", "async")
        specs.append(spec)
    return {"model": str(path), "engine_kwargs": engine_kwargs, "workloads": specs}


def config_groups(model: str, mode: str, args: argparse.Namespace) -> list[str]:
    if mode in ONE_ROW_MODES and "burst" not in args.workloads:
        return []
    groups = ["main"]
    if "overlap" in args.workloads and model == "small" and mode in ("sync", "async"):
        groups.append("overlap")
    return groups


def config_env(mode: str, group: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NEURON_SCHED_STATS_INTERVAL_S": "0",
        "VLLM_NEURON_SCHED_DISABLE": "1" if mode == "stock" else "0",
        "VLLM_NEURON_SCHED_TIMELINE": "0",  # the child times what it traces
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS": "0",
    }
    if group == "overlap":
        env["VLLM_NEURON_SCHED_DEVICE"] = "thread"
    if mode in ONE_ROW_MODES:
        env["VLLM_NEURON_SCHED_PREFILL_SHAPES"] = one_row_shapes(MAX_MODEL_LEN)
    return env


def one_row_shapes(max_tokens: int) -> str:
    """``1x16,1x32,...,1xMAX``: one request per prefill step, its chunk
    padded to a power of two, as before batched prefill."""
    shapes, tokens = [], 16
    while tokens < max_tokens:
        shapes.append(f"1x{tokens}")
        tokens *= 2
    return ",".join([*shapes, f"1x{max_tokens}"])


def num_units(spec: dict[str, Any]) -> int:
    """Progress units a child reports: start-up, then one per repeat."""
    units = 1
    for wl in spec["workloads"]:
        points = len(wl["sim_ms"]) if wl["kind"] == "overlap" else 1
        units += points * wl["repeats"]
    return units


def run_child(
    spec: dict[str, Any], env: dict[str, str], log: Path, bar: tqdm, timeout_s: float
) -> dict[str, Any]:
    """Runs one configuration; its logs (stdout and stderr) go to ``log``."""
    deadline = time.monotonic() + timeout_s
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        result = None
        for line in proc.stdout:
            if line.startswith(PROGRESS_MARKER):
                bar.update(1)
            elif line.startswith(RESULT_MARKER):
                result = json.loads(line[len(RESULT_MARKER) :])
            else:  # vLLM logs to stdout
                stderr.write(line)
            if time.monotonic() > deadline:
                proc.kill()
                break
        proc.wait()
    if result is None:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"child failed (rc {proc.returncode}), log {log}:\n{tail}")
    return result


def spread(values: list[float | None]) -> dict[str, float] | None:
    """Median, min and max over repeats (None values dropped)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def paired_ratio(
    numer: list[dict[str, Any]], denom: list[dict[str, Any]], key: str
) -> dict[str, float] | None:
    """Ratio per repeat index (repeat r of one mode over repeat r of the
    other), then median/min/max."""
    ratios = [
        a[key] / b[key] for a, b in zip(numer, denom) if a.get(key) and b.get(key)
    ]
    return spread(ratios)


def summarize(raw: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    """Per model/workload/mode medians; the ratios; overlap efficiency."""
    figures: dict[str, Any] = {}
    ratios: dict[str, dict[str, Any]] = {
        "async_over_sync": {},
        "async_over_stock": {},
        "async_over_stock_async": {},
        "async_step_fraction": {},
        "async_host_waits": {},
        "dead_tokens_per_request": {},
        "ttft_extra_steps": {},
        "steady_async_over": {},
        "ttft_async_over_stock": {},
        "burst": {},
    }
    peak_rss: dict[str, dict[str, float]] = {}
    for model, modes in raw.items():
        peak_rss[model] = {mode: r.get("peak_rss_mb") for mode, r in modes.items()}
        names = {n for r in modes.values() for n in r["workloads"] if n != "overlap"}
        for name in sorted(names):
            reps = {
                mode: r["workloads"][name]["repeats"]
                for mode, r in modes.items()
                if name in r["workloads"]
            }
            figures.setdefault(model, {})[name] = {
                mode: {
                    key: spread([rep.get(key) for rep in rs])
                    for key in (
                        "output_tok_s",
                        "steady_tok_s",
                        "ttft_s",
                        "ttft_p90_s",
                        "tpot_s",
                        "elapsed_s",
                    )
                }
                for mode, rs in reps.items()
            }
            key = f"{model}/{name}"
            if "async" in reps:
                for other, label in (
                    ("sync", "async_over_sync"),
                    ("stock", "async_over_stock"),
                    ("stock_async", "async_over_stock_async"),
                ):
                    if other in reps:
                        ratios[label][key] = paired_ratio(
                            reps["async"], reps[other], "output_tok_s"
                        )
                if name == "steady":  # the same decode batch in every mode
                    ratios["steady_async_over"][key] = {
                        other: paired_ratio(reps["async"], reps[other], "steady_tok_s")
                        for other in reps
                        if other != "async"
                    }
                if "stock" in reps:
                    ratios["ttft_async_over_stock"][key] = paired_ratio(
                        reps["async"], reps["stock"], "ttft_s"
                    )
                if name == "burst":
                    ratios["burst"][key] = {
                        f"{mode}_over_stock": {
                            metric: paired_ratio(reps[mode], reps["stock"], metric)
                            for metric in ("output_tok_s", "ttft_s", "ttft_p90_s")
                        }
                        for mode in reps
                        if mode != "stock" and "stock" in reps
                    }
                ratios["async_step_fraction"][key] = _step_fraction(reps["async"])
                ratios["async_host_waits"][key] = spread(
                    [
                        (r.get("sched_stats") or {}).get("host_waits")
                        for r in reps["async"]
                    ]
                )
                ratios["dead_tokens_per_request"][key] = _dead_tokens(reps["async"])
                if "sync" in reps:
                    ratios["ttft_extra_steps"][key] = spread(
                        [
                            (a["ttft_s"] - s["ttft_s"]) / s["tpot_s"]
                            for a, s in zip(reps["async"], reps["sync"])
                            if s.get("tpot_s")
                        ]
                    )
    overlap = _overlap(raw.get("small", {}))
    return {
        "figures": figures,
        **ratios,
        "overlap_efficiency": {p: v["overlap_efficiency"] for p, v in overlap.items()},
        "overlap": overlap,
        "peak_rss_mb": peak_rss,
    }


def _step_fraction(repeats: list[dict[str, Any]]) -> dict[str, float] | None:
    """Async steps (decode rows fed from the device token table, no host
    wait) over async + fallback steps (the host needed a device result the
    engine had not read): structural counts, the same on every backend."""
    fractions = []
    for rep in repeats:
        stats = rep.get("sched_stats")
        if stats:
            decode = stats["async_steps"] + stats["sync_fallback_steps"]
            fractions.append(stats["async_steps"] / decode if decode else None)
    return spread(fractions)


def _dead_tokens(repeats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Dead tokens per request that ended on a stop token (those ending on
    max_tokens never get one: the decode-heavy runs show 0)."""
    out = []
    for rep in repeats:
        stats = rep.get("sched_stats")
        if stats is None:
            continue
        num_stop = rep["num_finished_stop"]
        out.append(
            {
                "dead_tokens": stats.get("dead_tokens", 0),
                "finished_stop": num_stop,
                "finished_length": rep["num_finished_length"],
                "per_stop_request": stats.get("dead_tokens", 0) / num_stop
                if num_stop
                else None,
            }
        )
    return {"repeats": out} if out else None


def _overlap(small: dict[str, Any]) -> dict[str, Any]:
    """T_cpu = sync step - T_dev (sync run): everything on the critical path
    that is not the device (engine core, IPC, worker host). Efficiency =
    async step / max(T_cpu, T_dev), per repeat index."""
    sync = small.get("sync", {}).get("workloads", {}).get("overlap")
    asyn = small.get("async", {}).get("workloads", {}).get("overlap")
    if not sync or not asyn:
        return {}
    result = {}
    for point, sync_point in sync["points"].items():
        s_reps = sync_point["repeats"]
        a_reps = asyn["points"][point]["repeats"]
        effs, t_cpus = [], []
        for s, a in zip(s_reps, a_reps):
            if None in (s.get("step_s"), s.get("t_dev_s"), a.get("step_s")):
                continue
            t_cpu = s["step_s"] - s["t_dev_s"]
            t_cpus.append(t_cpu)
            effs.append(a["step_s"] / max(t_cpu, s["t_dev_s"]))
        result[f"{point}ms"] = {
            "overlap_efficiency": spread(effs),
            "t_cpu_ms": _ms(spread(t_cpus)),
            "t_dev_ms": _ms(spread([s.get("t_dev_s") for s in s_reps])),
            "sync_step_ms": _ms(spread([s.get("step_s") for s in s_reps])),
            "async_step_ms": _ms(spread([a.get("step_s") for a in a_reps])),
            "async_t_dev_ms": _ms(spread([a.get("t_dev_s") for a in a_reps])),
            "sync_worker_host_ms": _ms(
                spread([s.get("t_host_worker_s") for s in s_reps])
            ),
            "async_worker_host_ms": _ms(
                spread([a.get("t_host_worker_s") for a in a_reps])
            ),
            "async_over_sync": paired_ratio(s_reps, a_reps, "step_s"),
        }
    return result


def _ms(value: dict[str, float] | None) -> dict[str, float] | None:
    return None if value is None else {k: v * 1e3 for k, v in value.items()}


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch
    import vllm

    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
    }


def write_artefacts(raw: dict[str, Any], args: argparse.Namespace, out: Path) -> dict:
    """Chrome trace + PNG of the small model's decode-heavy run, sync vs
    async, and of the overlap sweep's largest simulated latency."""
    small = raw.get("small", {})
    timelines, batch = {}, workloads(args.quick, args.repeats)
    for mode in ("sync", "async"):
        wl = small.get(mode, {}).get("workloads", {})
        if wl.get("decode_heavy", {}).get("timeline"):
            timelines[f"ours {mode}: decode_heavy"] = wl["decode_heavy"]["timeline"]
    sim_timelines = {}
    for mode in ("sync", "async"):
        points = small.get(mode, {}).get("workloads", {}).get("overlap", {})
        if points:
            point = str(max(int(p) for p in points["points"]))
            tl = points["points"][point]["timeline"]
            if tl:
                sim_timelines[f"ours {mode}: sim device {point} ms"] = tl
    paths: dict[str, str] = {}
    if timelines or sim_timelines:
        trace = out / "timeline_trace.json"
        chrome_trace({**timelines, **sim_timelines}, trace)
        paths["chrome_trace"] = str(trace)
    png = out / "timeline_decode_heavy.png"
    n = batch["decode_heavy"]["num_requests"]
    if timelines and plot_timelines(timelines, n, png, "small model, decode-heavy"):
        paths["png"] = str(png)
    png = out / "timeline_sim_device.png"
    n = batch["overlap"]["num_requests"]
    if sim_timelines and plot_timelines(sim_timelines, n, png, "simulated device"):
        paths["png_sim_device"] = str(png)
    return paths


def ensure_models(names: list[str]) -> None:
    from vllm_neuron_sched.testing.checkpoint import CheckpointSpec, make_checkpoint

    for name in names:
        path, kwargs = MODELS[name]
        if not (path / "config.json").exists():
            make_checkpoint(path, CheckpointSpec(**kwargs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, ~3 min")
    parser.add_argument("--json", type=Path, default=None, help="report path")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--models", default=None, help="comma list: small,large")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list")
    parser.add_argument(
        "--workloads",
        default="steady,decode_heavy,burst,mixed,overlap",
        help="comma list: steady,decode_heavy,burst,mixed,overlap",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200, help="s per config")
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    check_plotting()  # before any engine starts, not after the last one
    models = (args.models or ("small" if args.quick else "small,large")).split(",")
    modes = [m for m in MODES if m in args.modes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or args.out / "bench.json"
    ensure_models(models)

    load_start = os.getloadavg()
    configs = [
        (model, mode, group)
        for model in models
        for mode in modes
        for group in config_groups(model, mode, args)
    ]
    specs = {c: config_spec(*c, args) for c in configs}
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    with tqdm(total=sum(num_units(s) for s in specs.values()), unit="run") as bar:
        for model, mode, group in configs:
            name = f"{model}/{mode}" + ("/overlap" if group == "overlap" else "")
            bar.set_description(name)
            log = args.out / f"{name.replace('/', '_')}.log"
            try:
                result = run_child(
                    specs[model, mode, group],
                    config_env(mode, group),
                    log,
                    bar,
                    args.timeout,
                )
            except RuntimeError as exc:  # report it, run the others
                errors[name] = str(exc)[-2000:]
                bar.write(f"{name} failed, see {log}")
                continue
            runs = raw.setdefault(model, {})
            if group == "main":
                runs[mode] = {**result, **runs.get(mode, {})}
            else:
                runs.setdefault(mode, {"workloads": {}})
                runs[mode]["workloads"].update(result["workloads"])
    report = {
        "command": " ".join(["python -m benchmarks.run", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "machine": machine(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "workloads": workloads(args.quick, args.repeats),
        **summarize(raw, args.quick),
        "errors": errors,
        "startup_s": {
            model: {mode: r.get("startup_s") for mode, r in runs.items()}
            for model, runs in raw.items()
        },
    }
    # The figures first: a failing plot must not lose them.
    json_path.write_text(json.dumps(report, indent=2))
    (args.out / "raw.json").write_text(json.dumps(raw))
    try:
        report["artefacts"] = write_artefacts(raw, args, args.out)
    except Exception as exc:
        report["artefacts"] = {"error": repr(exc)}
        print(f"timeline artefacts failed ({exc!r}); the figures are in {json_path}")
    json_path.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"report: {json_path}")


def print_summary(report: dict[str, Any]) -> None:
    def fmt(value: dict[str, float] | None, scale: float = 1.0) -> str:
        if not value:
            return "-"
        low, mid, high = (value[k] * scale for k in ("min", "median", "max"))
        return f"{mid:.3g} [{low:.3g}, {high:.3g}]"

    for model, wls in report["figures"].items():
        for name, modes in wls.items():
            print(f"\n{model}/{name}: tok/s | TTFT ms | TPOT ms  (median [min, max])")
            for mode, f in modes.items():
                print(
                    f"  {mode:12s} {fmt(f['output_tok_s']):28s} "
                    f"{fmt(f['ttft_s'], 1e3):28s} {fmt(f['tpot_s'], 1e3)}"
                )
    for label in ("async_over_sync", "async_over_stock", "async_over_stock_async"):
        for key, value in report[label].items():
            print(f"{label:24s} {key:22s} {fmt(value)}")
    for point, value in report["overlap"].items():
        print(
            f"overlap {point:5s} eff {fmt(value['overlap_efficiency'])}  "
            f"T_cpu {fmt(value['t_cpu_ms'])} ms  T_dev {fmt(value['t_dev_ms'])} ms  "
            f"async step {fmt(value['async_step_ms'])} ms"
        )


if __name__ == "__main__":
    main()
