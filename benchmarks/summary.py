"""The report's figures from the children's raw results: medians with min
and max over repeats, ratios between modes paired per repeat, and the
overlap sweep's efficiency. Pure functions over plain dicts."""

import statistics
from typing import Any


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


def summarize(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
