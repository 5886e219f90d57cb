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
    # True: later executions rely on what this one writes (KV zeroing); its
    # failure leaves the device state unknown.
    updates_state: bool = False


class Device(ABC):
    """An accelerator without streams (AWS Neuron async mode), as the host sees it.

    Executions run one at a time in enqueue order, each after its input futures
    resolve; outputs are futures, and a failure surfaces at their ``result()``.
    A failed *state update* (``enqueue_state_update``) fails every later
    execution with ``DeviceStateError``, so no result computed on top of an
    unknown state reaches anyone.
    """

    kind: str  # the backend, as VLLM_NEURON_SCHED_DEVICE names it
    # True: an execution completes inside enqueue(), on the caller's thread,
    # so nothing it reads can change under it.
    runs_at_enqueue: bool = False
    # True: the runner compiles every program once per declared shape before
    # serving, and a new shape while serving is an error.
    compiles_per_shape: bool = False

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        self.label = label  # names the device thread, futures and log lines
        self.sim_device_s = sim_device_ms / 1000.0
        # Reliability tests: this execution (1-based) raises; 0 = never.
        self.fault_at_execution = envs.VLLM_NEURON_SCHED_FAULT_AT_EXECUTION
        self._count_lock = threading.Lock()  # guards the count below
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
        with self._count_lock:
            self.fault_at_execution = self._num_enqueued + num_executions

    @abstractmethod
    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stops the device (idempotent): what is queued completes, and it
        returns once the device has stopped (or ``timeout_s`` passed, with a
        warning), so nothing an execution uses is released under it. Later
        enqueues raise ``DeviceShutdownError``."""

    @abstractmethod
    def _submit(self, execution: Execution) -> None:
        """Hands one execution to the backend, which runs it with ``_run``;
        raises ``DeviceShutdownError`` if shut down."""

    def _enqueue(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        updates_state: bool,
    ) -> DeviceFuture[T]:
        fn_name = getattr(fn, "__qualname__", repr(fn))
        future: DeviceFuture[T] = DeviceFuture(f"{self.label}:{fn_name}")
        with self._count_lock:
            self._num_enqueued += 1
            number = self._num_enqueued
        self._submit(
            Execution(fn, args, kwargs, future, self.tag, number, updates_state)
        )
        return future

    def _run(self, execution: Execution) -> None:
        """Runs one execution on the calling thread and completes its future,
        even if something escapes ``_execute`` (an ``on_execution`` callback
        that raised); only a non-``Exception`` (SystemExit) also goes up."""
        try:
            self._execute(execution)
        except BaseException as exc:
            execution.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    def _execute(self, execution: Execution) -> None:
        """The contract's rules around ``fn``; every outcome, failures
        included, goes into the future."""
        future = execution.future
        try:
            if self._state_failure is not None:
                raise DeviceStateError(
                    f"{future.label} not run: the device state is unknown since "
                    f"a state update failed ({self._state_failure!r})"
                ) from self._state_failure
            args = tuple(_resolve(a, future.label) for a in execution.args)
            kwargs = {k: _resolve(v, future.label) for k, v in execution.kwargs.items()}
        except DeviceExecutionError as not_run:  # the state or an input failed
            future.set_exception(not_run)
            return
        start = time.perf_counter()
        try:
            if execution.number == self.fault_at_execution:
                raise RuntimeError(
                    f"injected device fault at execution {self.fault_at_execution}"
                )
            value = execution.fn(*args, **kwargs)
        except Exception as exc:
            logger.debug("Device %s: %s raised %r", self.label, future.label, exc)
            if execution.updates_state:
                logger.error(
                    "Device %s: state update %s failed; every later execution "
                    "will fail",
                    self.label,
                    future.label,
                    exc_info=exc,
                )
                self._state_failure = exc
            self._hold_and_report(execution, start)
            future.set_exception(exc)
        else:
            self._hold_and_report(execution, start)
            future.set_result(value)

    def _hold_and_report(self, execution: Execution, start: float) -> None:
        """Simulated latency: the device stays held (the output not ready)
        without using a core, so overlap can be measured on CPU."""
        if self.sim_device_s > 0:
            time.sleep(self.sim_device_s)
        if self.on_execution is not None:
            self.on_execution(
                execution.future.label, execution.tag, start, time.perf_counter()
            )


def _resolve(arg: Any, label: str) -> Any:
    """An argument as the execution sees it: a future (top level only; never
    searched for inside containers, which hold a step's tensors) becomes its
    result. Executions run in enqueue order, so it is done by now. A failed
    input fails execution ``label`` ("failed upstream", naming the root
    cause). An input cannot fail with ``DeviceStateError``: that error
    means this device's state failed, which ``_execute`` checks first."""
    if not isinstance(arg, DeviceFuture):
        return arg
    try:
        return arg.result()
    except DeviceExecutionError as upstream:
        root: BaseException = upstream
        while root.__cause__ is not None:
            root = root.__cause__
        raise DeviceExecutionError(
            f"an input of {label} failed upstream: {root!r}"
        ) from upstream
