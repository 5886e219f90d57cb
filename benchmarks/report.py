"""What the benchmark writes besides its figures: the machine it ran on,
the timeline artefacts (Chrome trace, PNGs) and the terminal summary."""

import argparse
import os
import platform
from pathlib import Path
from typing import Any

from benchmarks.analysis import chrome_trace, plot_timelines
from benchmarks.configs import workloads


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
