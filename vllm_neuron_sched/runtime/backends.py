"""Device backends (thread, inline) and ``make_device``, which picks one.

A port to real hardware adds a backend here: docs/design.md, section 9, says
what it must implement and which tests to run against it."""

import queue
import threading

from vllm.logger import init_logger

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime.device import Device, Execution
from vllm_neuron_sched.runtime.future import DeviceFuture, DeviceShutdownError

logger = init_logger(__name__)

_STOP = object()  # queue sentinel: the device thread exits


class ThreadDevice(Device):
    """One daemon device thread runs executions FIFO, so enqueue never waits.

    No lock is held while an execution runs: torch releases the GIL inside its
    kernels, so the host thread keeps scheduling while the device computes.
    """

    name = "thread"

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        super().__init__(label, sim_device_ms)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the two fields below
        self._is_shut_down = False
        self._unfinished: set[DeviceFuture[object]] = set()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(
            target=self._run_loop, name=f"{label}-thread", daemon=True
        )
        self._thread.start()

    def synchronize(self) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("synchronize() from the device thread would deadlock")
        with self._idle:
            self._idle.wait_for(lambda: not self._unfinished)

    def shutdown(self, wait: bool = True, timeout_s: float | None = None) -> None:
        abandoned: list[DeviceFuture[object]] = []
        with self._lock:
            if not self._is_shut_down:
                self._is_shut_down = True
                self._queue.put(_STOP)
            if not wait:
                abandoned = list(self._unfinished)
                self._unfinished.clear()
                self._idle.notify_all()
        for future in abandoned:
            future._set_exception(
                DeviceShutdownError(
                    f"device {self.label!r} shut down before this execution completed"
                )
            )
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning(
                    "Device %s still running %s s into shutdown", self.label, timeout_s
                )

    def _submit(self, execution: Execution) -> None:
        with self._lock:
            if self._is_shut_down:
                raise DeviceShutdownError(f"device {self.label!r} is shut down")
            self._unfinished.add(execution.future)
            self._queue.put(execution)

    def _run_loop(self) -> None:
        while (execution := self._queue.get()) is not _STOP:
            assert isinstance(execution, Execution)
            if not execution.future.done():  # done = abandoned by shutdown
                try:
                    self._execute(execution)
                except BaseException as exc:  # keep the device thread alive
                    execution.future._set_exception(exc)
            with self._lock:
                self._unfinished.discard(execution.future)
                if not self._unfinished:
                    self._idle.notify_all()
        logger.debug("Device thread %s exits", self._thread.name)


class InlineDevice(Device):
    """Runs each execution at enqueue time, on the caller's thread: the CPU
    default, where the device is the worker's own cores. The futures and the
    flow are the same as on any other backend (only their timing differs), and
    errors still surface only at ``result()``, as on a real device."""

    name = "inline"
    runs_at_enqueue = True

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        super().__init__(label, sim_device_ms)
        self._lock = threading.Lock()  # one execution at a time across callers
        self._is_shut_down = False

    def synchronize(self) -> None:
        """Nothing to wait for: each execution completed inside its enqueue."""

    def shutdown(self, wait: bool = True, timeout_s: float | None = None) -> None:
        self._is_shut_down = True

    def _submit(self, execution: Execution) -> None:
        if self._is_shut_down:
            raise DeviceShutdownError(f"device {self.label!r} is shut down")
        with self._lock:
            self._execute(execution)


# Every backend kind but "auto" (envs.DEVICE_KINDS lists the same kinds).
DEVICE_BACKENDS: dict[str, type[Device]] = {
    "thread": ThreadDevice,
    "inline": InlineDevice,
}


def make_device(
    kind: str | None = None, sim_device_ms: float | None = None, name: str = "device"
) -> Device:
    """The device a worker runs on; unset arguments come from ``envs``
    (VLLM_NEURON_SCHED_DEVICE, VLLM_NEURON_SCHED_SIM_DEVICE_MS).

    ``auto`` picks ``inline`` when the device is the CPU worker's own cores
    and ``thread`` when executions also hold a simulated device. On the CPU
    a device thread can only time-slice with the worker's thread on the cores
    vLLM bound the worker to, and every torch op it dispatches takes the
    interpreter lock back from the host thread: measured, it loses to running
    inline (benchmarks/README.md). The overlap that async scheduling buys on
    the CPU is the engine core's, in its own process, which either backend
    keeps. A simulated (or real) device frees the worker's cores while it
    runs, and only a device thread lets the host use them meanwhile.
    """
    kind = (kind or envs.VLLM_NEURON_SCHED_DEVICE).lower()
    if sim_device_ms is None:
        sim_device_ms = envs.VLLM_NEURON_SCHED_SIM_DEVICE_MS
    if kind == "auto":
        kind = "thread" if sim_device_ms > 0 else "inline"
    backend = DEVICE_BACKENDS.get(kind)
    if backend is None:
        raise ValueError(
            f"unknown device kind {kind!r}; valid kinds: "
            f"auto, {', '.join(DEVICE_BACKENDS)}"
        )
    if sim_device_ms < 0:
        raise ValueError(f"sim_device_ms must be >= 0, got {sim_device_ms}")
    logger.debug(
        "Device %r: %s backend, simulated latency %.1f ms", name, kind, sim_device_ms
    )
    return backend(name, sim_device_ms)
