"""The benchmark's modules import with what the set-up installs, and its
figures and plots come out of a recorded timeline: a missing dependency
fails here, not at the end of a 15-minute run. No engine."""

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron_sched.testing.toy_runner import record_timeline

NUM_DECODES = 12


@pytest.mark.parametrize(
    "module",
    [
        "benchmarks.run",
        "benchmarks.configs",
        "benchmarks.summary",
        "benchmarks.report",
        "benchmarks.child",
        "benchmarks.analysis",
        "benchmarks.bench_serve",
        "benchmarks.serve_tp",
        "benchmarks.runtime_overhead",
        "benchmarks.pipeline",
        "benchmarks.speculative",
        "benchmarks.host_step",
        "benchmarks.sampling_step",
        "benchmarks.lora",
    ],
)
def test_benchmark_modules_import(module: str) -> None:
    importlib.import_module(module)


@pytest.fixture(scope="module")
def timeline() -> dict[str, Any]:
    """Two requests decoding together on the toy runner, as the worker sends
    its timeline over RPC."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
        mp.setenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", "1")
        recorded = record_timeline(True, NUM_DECODES, output_thread=True)
    return json.loads(json.dumps(recorded))


def test_step_figures_from_a_timeline(timeline: dict[str, Any]) -> None:
    from benchmarks.analysis import step_figures

    figures = step_figures(timeline, batch=2)
    assert figures["num_steady_steps"] == NUM_DECODES - 1  # periods between them
    for key in ("step_s", "t_dev_s", "t_host_worker_s"):
        assert figures[key] > 0, key


def test_trace_and_plot_are_written(timeline: dict[str, Any], tmp_path: Path) -> None:
    from benchmarks.analysis import check_plotting, chrome_trace, plot_timelines

    check_plotting()
    trace = tmp_path / "trace.json"
    chrome_trace({"toy async": timeline}, trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"host", "device"}
    png = tmp_path / "timeline.png"
    assert plot_timelines({"toy async": timeline}, 2, png, "toy")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_interleaved_turns_line_up_the_same_run_of_every_mode() -> None:
    """``--interleave``: repeat r of every mode runs in one round, the modes
    that trace take their traced run before anyone starts the next workload,
    and no mode always goes first."""
    from benchmarks.run import next_turns

    # Each mode's runs, as its child announces them: (workload, run), run 0
    # the warm-up, 1-2 the repeats, 3 the traced run (ours only).
    runs = {
        "stock": [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)],
        "async": [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
        "sync": [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
    }
    pending = {name: list(keys) for name, keys in runs.items()}
    waiting = {name: keys.pop(0) for name, keys in pending.items()}
    rounds: list[list[tuple[str, tuple[int, int]]]] = []
    while waiting:
        turn = [(name, waiting[name]) for name in next_turns(waiting, len(rounds))]
        for name, _ in turn:
            del waiting[name]
            if pending[name]:
                waiting[name] = pending[name].pop(0)
        rounds.append(turn)

    keys = [sorted({key for _, key in turn}) for turn in rounds]
    assert all(len(k) == 1 for k in keys)  # one run of one workload per round
    assert [k[0] for k in keys] == sorted({k for ks in runs.values() for k in ks})
    traced = [sorted(name for name, _ in turn) for turn in rounds if turn[0][1][1] == 3]
    assert traced == [["async", "sync"], ["async", "sync"]]
    firsts = {turn[0][0] for turn in rounds if len(turn) == 3}
    assert len(firsts) == 3  # the first turn rotates over the modes
