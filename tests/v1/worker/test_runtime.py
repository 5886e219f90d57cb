"""The device runtime contract (docs/design.md sections 2 and 9), on every
registered backend. Synchronisation uses Events and Barriers only: no timing
asserts."""

import threading
import time
import traceback
from collections.abc import Callable, Iterator

import pytest

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime import (
    Device,
    DeviceExecutionError,
    DeviceFuture,
    DeviceStateError,
    InlineDevice,
    Materializer,
    ThreadDevice,
    make_device,
)
from vllm_neuron_sched.runtime.backends import DEVICE_BACKENDS

WAIT_S = 10.0  # upper bound for Event waits, only reached when a test fails
# Every registered backend: a new one is held to the same contract.
KINDS = pytest.mark.parametrize("kind", sorted(DEVICE_BACKENDS))


@pytest.fixture
def new_device() -> Iterator[Callable[..., Device]]:
    """Builds devices and shuts them all down after the test."""
    devices: list[Device] = []

    def build(kind: str, sim_device_ms: float = 0.0, name: str = "dev") -> Device:
        device = make_device(kind, sim_device_ms, name)
        devices.append(device)
        return device

    yield build
    for device in devices:
        device.shutdown(wait=True)


def _raise_boom() -> None:
    raise ValueError("boom")


def _blocked_until(gate: threading.Event, started: threading.Event, value=1):
    """An execution that holds the device until the test opens ``gate``."""

    def run() -> object:
        started.set()
        assert gate.wait(WAIT_S)
        return value

    return run


@KINDS
def test_executions_run_in_enqueue_order(kind, new_device):
    device = new_device(kind)
    order: list[int] = []

    def record(i: int) -> int:
        time.sleep(0.001 * (i % 3))
        order.append(i)
        return i

    futures = [device.enqueue(record, i) for i in range(100)]
    device.synchronize()
    assert order == list(range(100))
    assert [f.result() for f in futures] == list(range(100))
    assert device.stats()["executions"] == 100


@KINDS
def test_future_arguments_are_resolved_on_the_device(kind, new_device):
    """Top-level futures become their results; containers are passed as they
    are (the same object, so an execution may fill a host buffer in place)."""
    device = new_device(kind)
    one = device.enqueue(lambda: 1)
    pair = device.enqueue(lambda: {"x": 2, "y": (3, 4)})
    host_buffer = [0]

    def combine(a, b, host, *, named):
        host.append(5)
        return a, b["x"], named

    out = device.enqueue(combine, one, pair, host_buffer, named=one)
    assert out.result() == (1, 2, 1)
    assert host_buffer == [0, 5]


@KINDS
def test_select_derives_without_extra_execution(kind, new_device):
    device = new_device(kind)
    out = device.enqueue(lambda: ((10, 20), {"logits": "L"}))
    assert out.select(0).select(1).result() == 20
    assert out.select(1).select("logits").result() == "L"
    assert device.stats()["executions"] == 1
    with pytest.raises(DeviceExecutionError) as info:
        out.select(5).result()
    assert isinstance(info.value.__cause__, IndexError)


def test_completed_future():
    future = DeviceFuture.completed([1, 2])
    assert future.done()
    assert future.result() == [1, 2]
    assert future.select(1).result() == 2


def test_result_timeout_on_pending_future(new_device):
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    future = device.enqueue(_blocked_until(gate, started))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    gate.set()
    assert future.result() == 1


def test_chain_runs_on_device_thread_without_host_read(new_device):
    device = new_device("thread", name="chain")
    gate, started = threading.Event(), threading.Event()
    threads: list[str] = []

    def first() -> int:
        threads.append(threading.current_thread().name)
        started.set()
        assert gate.wait(WAIT_S)
        return 1

    def step(x: int) -> int:
        threads.append(threading.current_thread().name)
        return x + 1

    head = device.enqueue(first)
    assert started.wait(WAIT_S)
    tail = head
    for _ in range(3):  # enqueue returns while `first` still holds the device
        tail = device.enqueue(step, tail)
    assert not head.done() and not tail.done()
    gate.set()
    assert tail.result() == 4
    assert threads == ["chain-thread"] * 4


@KINDS
def test_error_surfaces_at_result_with_device_traceback(kind, new_device):
    device = new_device(kind)
    future = device.enqueue(_raise_boom)  # enqueue itself does not raise
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
    selected = failed.select(0)
    unrelated = device.enqueue(lambda: ran.append("unrelated") or 7)
    with pytest.raises(DeviceExecutionError, match="upstream") as info:
        dependent.result()
    assert "_raise_boom" in "".join(traceback.format_exception(info.value))
    with pytest.raises(DeviceExecutionError, match="boom"):
        selected.result()
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


def test_shutdown_wait_completes_work_in_flight(new_device):
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    futures = [device.enqueue(_blocked_until(gate, started))]
    futures += [device.enqueue(lambda i=i: i) for i in range(5)]
    assert started.wait(WAIT_S)
    stopper = threading.Thread(target=device.shutdown, kwargs={"wait": True})
    stopper.start()
    gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert [f.result(timeout=0) for f in futures] == [1, 0, 1, 2, 3, 4]
    device.shutdown()  # idempotent


def test_shutdown_nowait_fails_pending_futures(new_device):
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []
    running = device.enqueue(_blocked_until(gate, started))
    queued = device.enqueue(lambda: ran.append(1))
    assert started.wait(WAIT_S)
    device.shutdown(wait=False)  # returns although `running` holds the device
    for future in (running, queued):
        with pytest.raises(DeviceExecutionError, match="shut down"):
            future.result()
    device.synchronize()  # nothing left to wait for
    gate.set()
    device.shutdown(wait=True)
    assert ran == []


@KINDS
def test_enqueue_after_shutdown_raises(kind, new_device):
    device = new_device(kind)
    device.shutdown()
    device.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="shut down"):
        device.enqueue(lambda: 1)


def test_sim_latency_holds_device_while_host_progresses(new_device):
    """The simulated latency keeps the device busy (not a host core): the
    host enqueues more while the first execution is held, and every
    execution's busy time includes the latency."""
    num_executions, sim_ms = 3, 20.0
    device = new_device("thread", sim_device_ms=sim_ms)
    gate, started = threading.Event(), threading.Event()
    first = device.enqueue(_blocked_until(gate, started))
    assert started.wait(WAIT_S)
    rest = [device.enqueue(lambda i=i: i) for i in range(num_executions - 1)]
    assert not first.done() and not any(f.done() for f in rest)
    gate.set()
    assert [first.result(), *(f.result() for f in rest)] == [1, 0, 1]
    stats = device.stats()
    assert stats["executions"] == num_executions
    assert stats["busy_s"] >= num_executions * sim_ms / 1000


def test_inline_runs_at_enqueue_on_caller_thread(new_device):
    device = new_device("inline", sim_device_ms=1.0)
    callers: list[threading.Thread] = []
    future = device.enqueue(lambda: callers.append(threading.current_thread()))
    assert future.done()
    assert callers == [threading.current_thread()]
    assert device.stats()["busy_s"] >= 0.001


def test_thread_backend_names_its_daemon_thread(new_device):
    device = new_device("thread", name="worker0")
    thread = device.enqueue(threading.current_thread).result()
    assert thread.name == "worker0-thread"
    assert thread.daemon
    assert thread is not threading.current_thread()


def test_the_variable_and_the_registry_list_the_same_kinds():
    assert ("auto", *DEVICE_BACKENDS) == envs.DEVICE_KINDS


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="auto, thread, inline$"):
        make_device("cuda")


def test_envs_select_backend_and_latency(monkeypatch, new_device):
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "inline")
    monkeypatch.setenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", "2.5")
    device = make_device()
    assert isinstance(device, InlineDevice)
    assert device.name == "inline"
    assert device.sim_device_s == pytest.approx(0.0025)
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    monkeypatch.delenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS")
    device = make_device(name="envs")
    try:
        assert isinstance(device, ThreadDevice)
        assert device.name == "thread"
        assert device.sim_device_s == 0.0
    finally:
        device.shutdown()


def test_auto_runs_inline_on_the_workers_cores_and_threads_a_held_device(
    monkeypatch,
):
    """The default: a CPU worker's device is its own cores (inline); a
    simulated device latency frees them, which only a device thread uses."""
    monkeypatch.delenv("VLLM_NEURON_SCHED_DEVICE", raising=False)
    monkeypatch.delenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", raising=False)
    assert isinstance(make_device(), InlineDevice)
    device = make_device(sim_device_ms=1.0)
    try:
        assert isinstance(device, ThreadDevice)
    finally:
        device.shutdown()


@KINDS
def test_a_failed_state_update_fails_every_later_execution(kind, new_device):
    device = new_device(kind)
    before = device.enqueue(lambda: 1)
    device.enqueue_state_update(_raise_boom)
    after = device.enqueue(lambda: 2)
    dependent = device.enqueue(lambda x: x, after)
    assert before.result() == 1
    for future in (after, dependent):
        with pytest.raises(DeviceStateError, match="state is unknown") as info:
            future.result()
        assert isinstance(info.value.__cause__, ValueError)


def test_fail_execution_after_counts_enqueues_not_runs(new_device):
    """Executions still queued behind a held device do not count: the fault
    hits exactly the n-th one enqueued from now."""
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    held = device.enqueue(_blocked_until(gate, started))
    queued = device.enqueue(lambda: "queued")
    assert started.wait(WAIT_S)
    device.fail_execution_after(2)
    first, second = device.enqueue(lambda: 1), device.enqueue(lambda: 2)
    gate.set()
    assert (held.result(), queued.result(), first.result()) == (1, "queued", 1)
    with pytest.raises(DeviceExecutionError, match="injected device fault"):
        second.result()
