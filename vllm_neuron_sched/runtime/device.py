"""The device contract shared by every backend: ordered executions, futures out."""

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm.logger import init_logger

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime.future import (
    DeviceExecutionError,
    DeviceFuture,
    DeviceStateError,
    resolve_futures,
)

logger = init_logger(__name__)

T = TypeVar("T")


@dataclass
class Execution:
    """One enqueued call and the future its output goes to."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]  # may hold DeviceFutures (top level only)
    kwargs: dict[str, Any]  # same
    future: DeviceFuture[Any]
    tag: int = 0  # the host's ``Device.tag`` at enqueue (the worker's step)
    number: int = 0  # 1-based, in enqueue (and so execution) order
    # True: later executions rely on what this one writes (KV zeroing, the
    # token table's growth); its failure leaves the device state unknown.
    updates_state: bool = False


class Device(ABC):
    """An accelerator without streams (AWS Neuron async mode), as the host sees it.

    Executions run one at a time in enqueue order, each after its input futures
    resolve; outputs are futures, and a failure surfaces at their ``result()``.
    A failed *state update* (``enqueue_state_update``) fails every later
    execution with ``DeviceStateError``, so no result computed on top of an
    unknown state reaches anyone.
    """

    name: str = "device"  # backend kind: "thread" | "inline" | "neuron"
    # True: an execution completes inside enqueue(), on the caller's thread,
    # so nothing it reads can change under it.
    runs_at_enqueue: bool = False

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        self.label = label  # names the device thread and log lines
        self.sim_device_s = sim_device_ms / 1000.0
        self._stats_lock = threading.Lock()
        self._num_executions = 0
        self._busy_s = 0.0
        # Reliability tests: this execution (1-based) raises; 0 = never.
        self.fault_at_execution = envs.VLLM_NEURON_SCHED_FAULT_AT_EXECUTION
        self._num_enqueued = 0
        # The failure of a state update: set once, on the executing thread.
        self._state_failure: BaseException | None = None
        # Set by the host before it enqueues; carried by each execution.
        self.tag = 0
        # Called after each execution on the thread that ran it, with its
        # label, tag and perf_counter start and end (the step timeline).
        self.on_execution: Callable[[str, int, float, float], None] | None = None

    def enqueue(
        self, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> DeviceFuture[T]:
        """Queues ``fn(*args, **kwargs)``; futures among the arguments (not
        nested in them) are replaced by their results on the device side,
        never by a host read here."""
        return self._enqueue(fn, args, kwargs, updates_state=False)

    def enqueue_state_update(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues an execution whose writes later executions rely on. Nobody
        reads its output: if it fails, every later execution fails instead,
        with ``DeviceStateError`` chained to this failure."""
        self._enqueue(fn, args, {}, updates_state=True)

    def fail_execution_after(self, num_executions: int) -> None:
        """Reliability tests: the ``num_executions``-th execution enqueued from
        now raises instead of running (1: the next one)."""
        with self._stats_lock:
            self.fault_at_execution = self._num_enqueued + num_executions

    def _enqueue(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        updates_state: bool,
    ) -> DeviceFuture[T]:
        fn_name = getattr(fn, "__qualname__", repr(fn))
        future: DeviceFuture[T] = DeviceFuture(f"{self.label}:{fn_name}")
        with self._stats_lock:
            self._num_enqueued += 1
            number = self._num_enqueued
        execution = Execution(fn, args, kwargs, future, self.tag, number, updates_state)
        self._submit(execution)
        return future

    @abstractmethod
    def synchronize(self) -> None:
        """Waits until every execution enqueued so far has completed."""

    @abstractmethod
    def shutdown(self, wait: bool = True, timeout_s: float | None = None) -> None:
        """Stops the device (idempotent). wait=True completes queued work and
        returns once the device has stopped (or ``timeout_s`` passed), so
        nothing an execution uses is released under it; wait=False fails
        unfinished futures with DeviceShutdownError and returns at once."""

    @abstractmethod
    def _submit(self, execution: Execution) -> None:
        """Hands one execution to the backend; raises if shut down."""

    @property
    def busy_time_s(self) -> float:
        """Seconds spent executing: fn time plus simulated latency."""
        with self._stats_lock:
            return self._busy_s

    def stats(self) -> dict[str, float]:
        """Measured device time, for the benchmark's per-step accounting."""
        with self._stats_lock:
            return {"executions": self._num_executions, "busy_s": self._busy_s}

    def _execute(self, execution: Execution) -> None:
        """Runs one execution on the calling thread and completes its future;
        an exception goes into the future, never up the device thread."""
        future = execution.future
        if self._state_failure is not None:
            error = DeviceStateError(
                f"{future._label} not run: the device state is unknown since a "
                f"state update failed ({self._state_failure!r})"
            )
            error.__cause__ = self._state_failure
            future._set_exception(error)
            return
        try:
            args, kwargs = resolve_futures(execution.args, execution.kwargs)
        except DeviceStateError as unknown_state:
            future._set_exception(unknown_state)
            return
        except DeviceExecutionError as upstream:
            root: BaseException = upstream
            while root.__cause__ is not None:
                root = root.__cause__
            error = DeviceExecutionError(
                f"an input of {future._label} failed upstream: {root!r}"
            )
            error.__cause__ = upstream
            future._set_exception(error)
            return
        start = time.perf_counter()
        try:
            if execution.number == self.fault_at_execution:
                raise RuntimeError(
                    f"injected device fault at execution {self.fault_at_execution}"
                )
            value = execution.fn(*args, **kwargs)
        except Exception as exc:
            logger.debug("Device %s: %s raised %r", self.label, future._label, exc)
            if execution.updates_state:
                logger.error(
                    "Device %s: state update %s failed; every later execution "
                    "will fail",
                    self.label,
                    future._label,
                    exc_info=exc,
                )
                self._state_failure = exc
            self._hold_and_record(execution, start)
            future._set_exception(exc)
        else:
            self._hold_and_record(execution, start)
            future._set_result(value)

    def _hold_and_record(self, execution: Execution, start: float) -> None:
        """Simulated latency: the device stays held (the output not ready)
        without using a core, so overlap can be measured on CPU."""
        if self.sim_device_s > 0:
            time.sleep(self.sim_device_s)
        end = time.perf_counter()
        with self._stats_lock:
            self._num_executions += 1
            self._busy_s += end - start
        if self.on_execution is not None:
            self.on_execution(execution.future._label, execution.tag, start, end)
