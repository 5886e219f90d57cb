"""The benchmarks' step timeline (worker/timeline.py): structure only, never
durations. A stand-in runner drives a real thread device the way the model
runner does (enqueue in execute_model and sample_tokens, materialize at the
next step's start)."""

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_neuron_sched.runtime import DeviceFuture, make_device
from vllm_neuron_sched.worker.timeline import DEVICE, HOST, WAIT, StepTimeline

NUM_STEPS = 6


class _Runner:
    def __init__(self) -> None:
        self.accelerator = make_device("thread", 1.0, "tp0")
        self._pending: SimpleNamespace | None = None

    def execute_model(self, scheduler_output: Any) -> None:
        if self._pending is not None:
            self._apply_sampled_tokens(self._pending)
        self.accelerator.enqueue(sum, [1, 2])

    def sample_tokens(self, grammar_output: Any) -> None:
        future: DeviceFuture[int] = self.accelerator.enqueue(sum, [3, 4])
        self._pending = SimpleNamespace(next_input_ids=future)

    def _apply_sampled_tokens(self, step: SimpleNamespace) -> None:
        step.next_input_ids.result()


@pytest.fixture
def recorded() -> dict[str, Any]:
    runner = _Runner()
    timeline = StepTimeline()
    timeline.instrument(runner)
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2
    )
    for _ in range(NUM_STEPS):
        runner.execute_model(scheduler_output)
        runner.sample_tokens(None)
    runner.accelerator.synchronize()
    runner.accelerator.shutdown()
    return timeline.snapshot(clear=True)


def _by_thread(intervals: list[list[Any]], kind: str) -> dict[str, list[list[Any]]]:
    threads: dict[str, list[list[Any]]] = {}
    for interval in intervals:
        if interval[0] == kind:
            threads.setdefault(interval[3], []).append(interval)
    return threads


def test_steps_are_numbered_in_order(recorded: dict[str, Any]) -> None:
    steps = recorded["steps"]
    assert [s[0] for s in steps] == list(range(1, NUM_STEPS + 1))
    assert all(s[2] == 2 and s[3] == 2 for s in steps)
    starts = [s[1] for s in steps]
    assert starts == sorted(starts)


def test_intervals_ordered_and_disjoint_per_thread(recorded: dict[str, Any]) -> None:
    intervals = recorded["intervals"]
    host = _by_thread(
        [i for i in intervals if i[1] in ("execute_model", "sample_tokens")], HOST
    )
    device = _by_thread(intervals, DEVICE)
    assert len(device) == 1 and "tp0-thread" in device
    for per_thread in [*host.values(), *device.values()]:
        ordered = sorted(per_thread, key=lambda i: i[4])
        for earlier, later in zip(ordered, ordered[1:]):
            assert earlier[4] <= earlier[5] <= later[4]


def test_device_runs_are_tagged_with_the_enqueuing_step(
    recorded: dict[str, Any],
) -> None:
    device = [i for i in recorded["intervals"] if i[0] == DEVICE]
    assert sorted(i[2] for i in device) == sorted(
        [step for step in range(1, NUM_STEPS + 1) for _ in range(2)]
    )


def test_waits_nest_in_materialize(recorded: dict[str, Any]) -> None:
    intervals = recorded["intervals"]
    materialize = [i for i in intervals if i[1] == "materialize"]
    assert len(materialize) == NUM_STEPS - 1
    for wait in (i for i in intervals if i[0] == WAIT):
        assert any(m[4] <= wait[4] <= wait[5] <= m[5] for m in materialize)


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NEURON_SCHED_TIMELINE", raising=False)
    assert StepTimeline.from_env() is None
    monkeypatch.setenv("VLLM_NEURON_SCHED_TIMELINE", "1")
    assert StepTimeline.from_env() is not None
