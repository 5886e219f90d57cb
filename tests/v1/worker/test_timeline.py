"""The benchmarks' step timeline (worker/timeline.py), subscribed to the real
runner's async flow on the toy model: structure only, never durations."""

import pytest

from vllm_neuron_sched.testing.toy_runner import record_timeline
from vllm_neuron_sched.worker.timeline import DEVICE, HOST, WAIT, StepTimeline

NUM_DECODES = 6
MAIN = "MainThread"


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def recorded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    monkeypatch.setenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", "1")
    return record_timeline(request.param, NUM_DECODES), request.param


def test_steps_are_numbered_in_order(recorded) -> None:
    timeline, _ = recorded
    steps = timeline["steps"]
    assert [s[0] for s in steps] == list(range(1, NUM_DECODES + 3))
    assert [(s[2], s[3]) for s in steps[:2]] == [(1, 5), (1, 3)]
    assert all((s[2], s[3]) == (2, 2) for s in steps[2:])
    starts = [s[1] for s in steps]
    assert starts == sorted(starts)


def test_host_intervals_are_ordered_and_disjoint_on_the_main_thread(recorded):
    timeline, _ = recorded
    host = [
        i
        for i in timeline["intervals"]
        if i[0] == HOST and i[1] in ("execute_model", "sample_tokens")
    ]
    assert {i[3] for i in host} == {MAIN}
    names = [i[1] for i in sorted(host, key=lambda i: i[4])]
    assert names == ["execute_model", "sample_tokens"] * (NUM_DECODES + 2)
    ordered = sorted(host, key=lambda i: i[4])
    for earlier, later in zip(ordered, ordered[1:]):
        assert earlier[4] <= earlier[5] <= later[4]


def test_device_runs_are_tagged_with_the_enqueuing_step(recorded) -> None:
    timeline, _ = recorded
    device = [i for i in timeline["intervals"] if i[0] == DEVICE]
    assert {i[3] for i in device} == {"tp0_0"}
    # Each step: its forward, then its sampling; the first three (a joins,
    # b joins as a leaves, a joins again) first their batch change.
    assert sorted(i[2] for i in device) == sorted(
        step for step in range(1, NUM_DECODES + 3) for _ in range(3 if step <= 3 else 2)
    )


def test_waits_happen_only_where_the_mode_says(recorded) -> None:
    """Sync: the main thread waits for every step's tokens, inside
    sample_tokens. Async: it never waits; reading outputs may."""
    timeline, is_async = recorded
    intervals = timeline["intervals"]
    main_waits = [i for i in intervals if i[0] == WAIT and i[3] == MAIN]
    sample_tokens = [i for i in intervals if i[1] == "sample_tokens"]
    if is_async:
        # Outputs are read on the test's (main) thread, outside the steps; the
        # last ones right after their step, while the device still holds them.
        assert main_waits
        steps = [i for i in intervals if i[1] in ("execute_model", "sample_tokens")]
        for wait in main_waits:
            assert not any(s[4] <= wait[4] <= s[5] for s in steps)
    else:
        assert len(main_waits) == NUM_DECODES + 2
        for wait in main_waits:
            assert any(s[4] <= wait[4] <= wait[5] <= s[5] for s in sample_tokens)


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NEURON_SCHED_TIMELINE", raising=False)
    assert StepTimeline.from_env() is None
    monkeypatch.setenv("VLLM_NEURON_SCHED_TIMELINE", "1")
    assert StepTimeline.from_env() is not None
