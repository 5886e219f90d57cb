"""From a worker timeline (``get_step_timeline``) to per-step figures, a
Chrome trace and a PNG. Pure functions over the timeline's plain lists."""

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

# Column order of the timeline's lists (vllm_neuron_sched/worker/timeline.py).
STEP, START, NUM_REQS, NUM_TOKENS = range(4)
KIND, NAME, ISTEP, THREAD, ISTART, IEND = range(6)
MAIN_THREAD = "MainThread"
TOP_LEVEL_HOST = ("execute_model", "sample_tokens")


def steady_steps(timeline: dict[str, Any], batch: int) -> list[int]:
    """Pure decode steps of the full batch: the steady state we measure."""
    return [
        s[STEP]
        for s in timeline["steps"]
        if s[NUM_REQS] == batch and s[NUM_TOKENS] == batch
    ]


def step_figures(timeline: dict[str, Any] | None, batch: int) -> dict[str, Any]:
    """Medians over steady steps: step period (execute_model entry to the
    next), device busy, worker host busy (main thread, waits excluded)."""
    if not timeline:
        return {}
    steady = steady_steps(timeline, batch)
    starts = {s[STEP]: s[START] for s in timeline["steps"]}
    is_steady = set(steady)
    periods = [
        starts[k + 1] - starts[k] for k in steady if k + 1 in is_steady and k > 0
    ]
    device: dict[int, float] = defaultdict(float)
    host: dict[int, float] = defaultdict(float)
    output_thread: dict[int, float] = defaultdict(float)
    for kind, name, step, thread, start, end in timeline["intervals"]:
        if step not in is_steady:
            continue
        if kind == "device":
            device[step] += end - start
            if thread == MAIN_THREAD:  # an inline device, inside host work
                host[step] -= end - start
        elif kind == "host" and thread == MAIN_THREAD and name in TOP_LEVEL_HOST:
            host[step] += end - start
        elif kind == "wait" and thread == MAIN_THREAD:
            host[step] -= end - start
        elif kind == "host" and name == "get_output":
            output_thread[step] += end - start

    def med(values: Any) -> float | None:
        values = list(values)
        return statistics.median(values) if values else None

    return {
        "num_steady_steps": len(periods),
        "step_s": med(periods),
        "t_dev_s": med(device[k] for k in steady),
        "t_host_worker_s": med(host[k] for k in steady),
        "t_output_thread_s": med(output_thread[k] for k in steady),
    }


def steady_window(
    timeline: dict[str, Any], batch: int, num_steps: int = 8
) -> tuple[float, float] | None:
    """A window of ``num_steps`` steady steps from the middle of the run."""
    steady = steady_steps(timeline, batch)
    if len(steady) < num_steps + 1:
        return None
    starts = {s[STEP]: s[START] for s in timeline["steps"]}
    first = steady[(len(steady) - num_steps) // 2]
    last = first + num_steps
    if last not in starts:
        return None
    return starts[first], starts[last]


def chrome_trace(timelines: dict[str, dict[str, Any]], path: Path) -> None:
    """One Perfetto/chrome://tracing process per label, one track per thread;
    complete ("X") events in microseconds from the earliest record."""
    events: list[dict[str, Any]] = []
    for pid, (label, timeline) in enumerate(timelines.items(), start=1):
        intervals = timeline["intervals"]
        if not intervals:
            continue
        origin = min(i[ISTART] for i in intervals)
        events.append(_meta("process_name", pid, 0, label))
        tids: dict[str, int] = {}
        for kind, name, step, thread, start, end in intervals:
            track = f"{thread} ({kind})" if kind == "device" else thread
            if track not in tids:
                tids[track] = len(tids) + 1
                events.append(_meta("thread_name", pid, tids[track], track))
            events.append(
                {
                    "name": name.split(".")[-1],
                    "cat": kind,
                    "ph": "X",
                    "ts": (start - origin) * 1e6,
                    "dur": (end - start) * 1e6,
                    "pid": pid,
                    "tid": tids[track],
                    "args": {"step": step},
                }
            )
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def check_plotting() -> None:
    """Fails at once, not after the last engine, when the plots cannot be
    drawn (matplotlib is in the ``bench`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"benchmarks need matplotlib for the timeline plots ({exc}): "
            'the README\'s set-up command: pip install -e ".[test,bench,real]" '
            "&& pip uninstall -y torchvision torchaudio torchcodec"
        ) from exc


def plot_timelines(
    timelines: dict[str, dict[str, Any]], batch: int, path: Path, title: str
) -> bool:
    """Device busy / host busy lanes over a few steady steps (a host thread's
    waits for the device drawn over its lane), one panel per label, same
    time scale. False when no timeline has a steady window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = {
        label: steady_window(timeline, batch) for label, timeline in timelines.items()
    }
    windows = {label: w for label, w in windows.items() if w is not None}
    if not windows:
        return False
    span_ms = max(end - start for start, end in windows.values()) * 1e3
    lanes = ("device", "host: worker main", "host: output thread")
    colors = {"device": "tab:orange", "host": "tab:blue", "wait": "tab:gray"}
    fig, axes = plt.subplots(
        len(windows), 1, figsize=(12, 1.6 + 1.3 * len(windows)), squeeze=False
    )
    for ax, (label, (w_start, w_end)) in zip(axes[:, 0], windows.items()):
        for kind, _, _, thread, start, end in timelines[label]["intervals"]:
            if end < w_start or start > w_end:
                continue
            if kind == "device":
                lane = "device"
            elif thread == MAIN_THREAD:
                lane = "host: worker main"
            else:
                lane = "host: output thread"
            y = lanes.index(lane)
            ax.broken_barh(
                [((start - w_start) * 1e3, (end - start) * 1e3)],
                (y - 0.4, 0.8),
                color=colors[kind],
                edgecolor="black",
                linewidth=0.3,
                zorder=3 if kind == "wait" else 2,  # waits drawn over host busy
            )
        step_ms = (w_end - w_start) * 1e3 / 8
        ax.set_title(
            f"{label}: 8 steady decode steps, {step_ms:.2f} ms/step "
            "(blue: host busy, grey: host waits for the device)"
        )
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlim(0, span_ms)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
