"""What is particular to each built-in device backend, and how one is
picked; the contract every backend keeps is test_device_contract.py."""

import threading

import pytest

from vllm_neuron_sched.runtime import (
    DeviceExecutionError,
    InlineDevice,
    ThreadDevice,
    make_device,
)
from vllm_neuron_sched.testing.conformance.test_device_contract import (
    WAIT_S,
    _blocked_until,
)


def test_result_timeout_on_pending_future(new_device):
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    future = device.enqueue(_blocked_until(gate, started))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    gate.set()
    assert future.result() == 1


def test_an_enqueued_execution_cannot_be_cancelled(new_device):
    """Only the device completes a future: a pending one refuses cancel()."""
    device = new_device("thread")
    gate, started = threading.Event(), threading.Event()
    future = device.enqueue(_blocked_until(gate, started))
    queued = device.enqueue(lambda: 2)
    assert not future.cancel() and not queued.cancel()
    gate.set()
    assert (future.result(), queued.result()) == (1, 2)


def test_chain_runs_on_device_thread_without_host_read(new_device):
    device = new_device("thread", label="chain")
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
    assert threads == ["chain_0"] * 4


def test_sim_latency_holds_device_while_host_progresses(new_device):
    """The simulated latency keeps the device busy (not a host core): the
    host enqueues more while the first execution is held."""
    device = new_device("thread", sim_device_ms=20.0)
    gate, started = threading.Event(), threading.Event()
    first = device.enqueue(_blocked_until(gate, started))
    assert started.wait(WAIT_S)
    rest = [device.enqueue(lambda i=i: i) for i in range(2)]
    assert not first.done() and not any(f.done() for f in rest)
    gate.set()
    assert [first.result(), *(f.result() for f in rest)] == [1, 0, 1]


def test_inline_runs_at_enqueue_on_caller_thread(new_device):
    device = new_device("inline", sim_device_ms=1.0)
    callers: list[threading.Thread] = []
    future = device.enqueue(lambda: callers.append(threading.current_thread()))
    assert future.done()
    assert callers == [threading.current_thread()]


def test_thread_backend_names_its_thread_after_the_label(new_device):
    """Not a daemon: the interpreter joins it at exit (ThreadDevice says why)."""
    device = new_device("thread", label="worker0")
    thread = device.enqueue(threading.current_thread).result()
    assert thread.name == "worker0_0"
    assert not thread.daemon
    assert thread is not threading.current_thread()


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="auto, thread, inline, compiled$"):
        make_device("cuda")


def test_envs_select_backend_and_latency(monkeypatch, new_device):
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "inline")
    monkeypatch.setenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", "2.5")
    device = make_device()
    assert isinstance(device, InlineDevice)
    assert device.kind == "inline"
    assert device.sim_device_s == pytest.approx(0.0025)
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    monkeypatch.delenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS")
    device = make_device(label="envs")
    try:
        assert isinstance(device, ThreadDevice)
        assert device.kind == "thread"
        assert device.label == "envs"
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
