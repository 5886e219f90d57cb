"""The device runtime contract (docs/design.md, sections 2 and 9): what every
backend, built in or installed by a port, must do. Run it against one kind::

    VLLM_NEURON_SCHED_DEVICE=<kind> python -m pytest \
        --pyargs vllm_neuron_sched.testing.conformance

Without the variable (or with ``auto``) it runs against every kind this
environment has: the built-in ``thread`` and ``inline`` and those installed
packages register (entry-point group ``vllm_neuron_sched.devices``).

Synchronisation uses Events and Barriers; the only sleeps give a broken
implementation time to show itself, and the only timing asserts are lower
bounds that a sleep guarantees."""

import logging
import os
import threading
import time
import traceback

import pytest

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime import (
    Device,
    DeviceExecutionError,
    DeviceFuture,
    DeviceShutdownError,
    DeviceStateError,
    Materializer,
)

WAIT_S = 10.0  # upper bound for Event waits, only reached when a test fails


def contract_kinds() -> list[str]:
    """The kind VLLM_NEURON_SCHED_DEVICE names, else every kind there is."""
    chosen = os.environ.get("VLLM_NEURON_SCHED_DEVICE", "").strip().lower()
    if chosen and chosen != "auto":
        return [chosen]
    return [kind for kind in envs.device_kinds() if kind != "auto"]


KINDS = pytest.mark.parametrize("kind", contract_kinds())


def _raise_boom() -> None:
    raise ValueError("boom")


def _blocked_until(gate: threading.Event, started: threading.Event, value=1):
    """An execution that holds the device until the test opens ``gate``."""

    def run() -> object:
        started.set()
        assert gate.wait(WAIT_S)
        return value

    return run


def _enqueue_held(
    device: Device, gate: threading.Event
) -> tuple[threading.Thread, list[DeviceFuture]]:
    """Enqueues an execution held by ``gate`` from another host thread (an
    inline device runs it there, inside enqueue); returns once it runs. Once
    that thread is joined, the list holds the execution's future."""
    started, held = threading.Event(), []
    host = threading.Thread(
        target=lambda: held.append(device.enqueue(_blocked_until(gate, started)))
    )
    host.start()
    assert started.wait(WAIT_S)
    return host, held


@KINDS
def test_executions_run_in_enqueue_order(kind, new_device):
    device = new_device(kind)
    order: list[int] = []

    def record(i: int) -> int:
        time.sleep(0.001 * (i % 3))
        order.append(i)
        return i

    futures = [device.enqueue(record, i) for i in range(100)]
    futures[-1].result()  # FIFO: the last one done means all are
    assert order == list(range(100))
    assert [f.result(timeout=0) for f in futures] == list(range(100))


@KINDS
def test_future_arguments_are_resolved_on_the_device(kind, new_device):
    """Top-level futures become their results; containers are passed as they
    are (the same object, so an execution may fill a host buffer in place)."""
    device = new_device(kind)
    one = device.enqueue(lambda: 1)
    pair = device.enqueue(lambda: {"x": 2, "y": (3, 4)})
    host_buffer = [0]
    nested = [one]

    def combine(a, b, host, inside, *, named):
        host.append(5)
        return a, b["x"], inside[0] is one, named

    out = device.enqueue(combine, one, pair, host_buffer, nested, named=one)
    assert out.result() == (1, 2, True, 1)
    assert host_buffer == [0, 5]


@KINDS
def test_error_surfaces_at_result_with_device_traceback(kind, new_device):
    device = new_device(kind)
    future = device.enqueue(_raise_boom)  # enqueue itself does not raise
    for _ in range(2):  # every read raises the same way
        with pytest.raises(DeviceExecutionError, match="dev:_raise_boom failed: "):
            future.result()
    with pytest.raises(DeviceExecutionError, match="boom") as info:
        future.result()
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, ValueError)
    assert "_raise_boom" in "".join(traceback.format_exception(info.value))


@KINDS
def test_dependent_fails_and_unrelated_succeeds(kind, new_device):
    device = new_device(kind)
    ran: list[str] = []
    failed = device.enqueue(_raise_boom)
    dependent = device.enqueue(lambda x: ran.append("dependent"), failed)
    grandchild = device.enqueue(lambda x: ran.append("grandchild"), dependent)
    unrelated = device.enqueue(lambda: ran.append("unrelated") or 7)
    for future in (dependent, grandchild):  # both name the root cause
        with pytest.raises(DeviceExecutionError, match="upstream: ValueError") as info:
            future.result()
        assert "_raise_boom" in "".join(traceback.format_exception(info.value))
    assert unrelated.result() == 7
    assert ran == ["unrelated"]


def test_materializer_runs_once_under_racing_readers():
    calls = []
    started, release = threading.Event(), threading.Event()
    barrier = threading.Barrier(2)

    def copy_to_host() -> list[int]:
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(WAIT_S)
        return [1, 2, 3]

    cell = Materializer(copy_to_host)
    results: dict[str, list[int]] = {}

    def reader() -> None:
        barrier.wait(WAIT_S)
        results[threading.current_thread().name] = cell.get()

    readers = [threading.Thread(target=reader, name=f"r{i}") for i in range(2)]
    for thread in readers:
        thread.start()
    assert started.wait(WAIT_S)
    assert not cell.is_materialized()
    release.set()
    for thread in readers:
        thread.join(WAIT_S)
    assert len(calls) == 1
    assert results["r0"] is results["r1"] == [1, 2, 3]
    assert cell.is_materialized()
    assert cell.get() is results["r0"]


def test_materializer_shares_its_exception():
    calls = []

    def fail() -> None:
        calls.append(1)
        raise ValueError("copy failed")

    cell = Materializer(fail)
    errors = []
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            cell.get()
        errors.append(info.value)
    assert calls == [1]
    assert errors[0] is errors[1]
    assert cell.is_materialized()


@KINDS
def test_shutdown_completes_work_in_flight_then_refuses_enqueues(kind, new_device):
    device = new_device(kind)
    gate, log = threading.Event(), []
    host, held = _enqueue_held(device, gate)
    queued = []
    if not device.runs_at_enqueue:  # an inline device has nothing queued
        queued = [device.enqueue(lambda i=i: log.append(i) or i) for i in range(3)]

    def stop() -> None:
        device.shutdown()
        log.append("shut down")

    stopper = threading.Thread(target=stop)
    stopper.start()
    stopper.join(0.1)  # a shutdown that does not wait returns meanwhile
    log.append("gate opened")
    gate.set()
    stopper.join(WAIT_S)
    host.join(WAIT_S)
    assert log == ["gate opened", *range(len(queued)), "shut down"]
    assert [f.result(timeout=0) for f in held + queued] == [1, *range(len(queued))]
    with pytest.raises(DeviceShutdownError, match="'dev' is shut down"):
        device.enqueue(lambda: 1)
    device.shutdown()  # idempotent


@KINDS
def test_shutdown_gives_up_after_its_timeout_and_warns(kind, new_device):
    device = new_device(kind)
    gate = threading.Event()
    host, held = _enqueue_held(device, gate)
    # On the module's own logger, at its level: engines started earlier in
    # the session hang our loggers under vLLM's, which propagates nothing to
    # pytest's capture and may log at another level.
    # The backend's module warns (a port's own, or ours if it inherits
    # shutdown).
    warnings = _Records()
    loggers = {
        logging.getLogger(cls.__module__)
        for cls in type(device).__mro__
        if issubclass(cls, Device)
    }
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.WARNING)
        logger.addHandler(warnings)
    try:
        device.shutdown(timeout_s=0.01)  # returns although the device is held
    finally:
        for logger, level in levels.items():
            logger.removeHandler(warnings)
            logger.setLevel(level)
        gate.set()
    assert "Device dev still running 0.01 s into shutdown" in warnings.text
    device.shutdown()
    host.join(WAIT_S)
    assert held[0].result(timeout=0) == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage() + "\n"


@KINDS
def test_enqueue_after_shutdown_raises(kind, new_device):
    device = new_device(kind)
    device.shutdown()
    device.shutdown()
    with pytest.raises(DeviceShutdownError, match="shut down"):
        device.enqueue(lambda: 1)
    with pytest.raises(DeviceShutdownError, match="shut down"):
        device.enqueue_state_update(lambda: 1)


@KINDS
def test_sim_latency_holds_each_execution_and_is_reported(kind, new_device):
    """Each execution holds the device its simulated latency before its output
    is ready; ``on_execution`` reports it with the host's tag."""
    sim_ms = 20.0
    device = new_device(kind, sim_device_ms=sim_ms)
    reported: list[tuple[str, int, float]] = []
    device.on_execution = lambda label, tag, start, end: reported.append(
        (label, tag, end - start)
    )

    def zero() -> int:
        return 0

    device.tag = 7
    start = time.perf_counter()
    assert device.enqueue(zero).result() == 0
    assert time.perf_counter() - start >= sim_ms / 1000
    device.tag = 8
    device.enqueue(_raise_boom)  # a failed execution holds the device too
    device.enqueue(zero).result()
    assert [(label, tag) for label, tag, _ in reported] == [
        ("dev:test_sim_latency_holds_each_execution_and_is_reported.<locals>.zero", 7),
        ("dev:_raise_boom", 8),
        ("dev:test_sim_latency_holds_each_execution_and_is_reported.<locals>.zero", 8),
    ]
    assert all(busy >= sim_ms / 1000 for _, _, busy in reported)


@KINDS
def test_a_raising_on_execution_callback_fails_that_future(kind, new_device):
    """Even what escapes the execution's rules reaches the host at result(),
    and the device keeps running."""
    device = new_device(kind)

    def broken_observer(label: str, tag: int, start: float, end: float) -> None:
        raise KeyError(label)

    device.on_execution = broken_observer
    future = device.enqueue(lambda: 1)  # enqueue itself does not raise
    with pytest.raises(DeviceExecutionError) as info:
        future.result()
    assert isinstance(info.value.__cause__, KeyError)
    device.on_execution = None
    assert device.enqueue(lambda: 2).result() == 2


@KINDS
def test_a_failed_state_update_fails_every_later_execution(kind, new_device):
    device = new_device(kind)
    ran: list[int] = []
    before = device.enqueue(lambda: 1)
    device.enqueue_state_update(_raise_boom)
    after = device.enqueue(lambda: ran.append(2))
    dependent = device.enqueue(lambda x: ran.append(3), after)
    assert before.result() == 1
    for future in (after, dependent):
        with pytest.raises(DeviceStateError, match="state is unknown") as info:
            future.result()
        assert isinstance(info.value.__cause__, ValueError)
    assert ran == []


@KINDS
def test_fault_injected_from_the_environment(kind, monkeypatch, new_device):
    monkeypatch.setenv("VLLM_NEURON_SCHED_FAULT_AT_EXECUTION", "2")
    device = new_device(kind)
    ran: list[int] = []
    futures = [device.enqueue(lambda i=i: ran.append(i) or i) for i in range(3)]
    assert futures[0].result() == 0
    with pytest.raises(
        DeviceExecutionError, match="injected device fault at execution 2"
    ):
        futures[1].result()
    assert futures[2].result() == 2
    assert ran == [0, 2]


@KINDS
def test_fail_execution_after_counts_from_now(kind, new_device):
    device = new_device(kind)
    device.enqueue(lambda: 0).result()
    device.fail_execution_after(2)
    first, second = device.enqueue(lambda: 1), device.enqueue(lambda: 2)
    assert first.result() == 1
    with pytest.raises(DeviceExecutionError, match="injected device fault"):
        second.result()
