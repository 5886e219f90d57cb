"""Futures for device outputs: where the host reads results, and errors, back."""

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from vllm.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


class DeviceExecutionError(RuntimeError):
    """A device execution failed; ``__cause__`` holds the device-side exception
    (with its traceback), so the host sees where it really went wrong."""


class DeviceStateError(DeviceExecutionError):
    """An execution that updates state later executions rely on (the KV
    cache, the token table) failed, so the device state is unknown: every
    later execution fails with this error, chained to the first failure."""


class DeviceShutdownError(RuntimeError):
    """The device was shut down: before this execution completed, or before an
    enqueue."""


class DeviceFuture(Generic[T]):
    """Output of one device execution; reading it on the host blocks until done.

    Completed exactly once by the backend; a later completion is ignored, so a
    shut-down device and an execution finishing in the background cannot race.
    """

    def __init__(self, label: str = "execution") -> None:
        self._label = label
        self._lock = threading.Lock()
        self._is_done = threading.Event()
        self._value: T | None = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[DeviceFuture[Any]], None]] = []

    @classmethod
    def completed(cls, value: T) -> "DeviceFuture[T]":
        """A future that is already done: host data passed where a future fits."""
        future: DeviceFuture[T] = cls("completed")
        future._set_result(value)
        return future

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"DeviceFuture({self._label!r}, {state})"

    def done(self) -> bool:
        return self._is_done.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Blocks until done; re-raises a device failure as DeviceExecutionError
        chained from the original exception."""
        if not self._is_done.wait(timeout):
            raise TimeoutError(f"{self._label} not done after {timeout} s")
        if isinstance(self._exception, DeviceStateError):
            raise self._exception
        if self._exception is not None:
            raise DeviceExecutionError(
                f"{self._label} failed: {self._exception!r}"
            ) from self._exception
        return self._value  # type: ignore[return-value]

    def select(self, key: Any) -> "DeviceFuture[Any]":
        """A future of ``result()[key]`` (tuple index or dict key), computed
        when this one completes: no extra device execution, no host wait."""
        child: DeviceFuture[Any] = DeviceFuture(f"{self._label}[{key!r}]")

        def forward(parent: DeviceFuture[Any]) -> None:
            if parent._exception is not None:
                child._set_exception(parent._exception)
                return
            try:
                child._set_result(parent._value[key])  # type: ignore[index]
            except Exception as exc:
                child._set_exception(exc)

        self._on_done(forward)
        return child

    def _on_done(self, callback: Callable[["DeviceFuture[Any]"], None]) -> None:
        """Calls ``callback(self)`` on completion, or now if already done."""
        with self._lock:
            if not self.done():
                self._callbacks.append(callback)
                return
        callback(self)

    def _set_result(self, value: T) -> bool:
        return self._complete(value, None)

    def _set_exception(self, exception: BaseException) -> bool:
        return self._complete(None, exception)

    def _complete(self, value: T | None, exception: BaseException | None) -> bool:
        with self._lock:
            if self.done():
                return False
            self._value, self._exception = value, exception
            self._is_done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("Callback of %s raised", self._label)
        return True


def resolve_futures(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Replaces the futures among the arguments (top level only) by their
    results. Arguments are never searched for nested futures: a step hands
    over whole tensors, lists of them and dicts keyed by layer (one entry per
    layer on a real model), and walking them per execution costs host time
    on every step for the one input that is a future (sampling's logits)."""
    if any(isinstance(a, DeviceFuture) for a in args):
        args = tuple(a.result() if isinstance(a, DeviceFuture) else a for a in args)
    if any(isinstance(v, DeviceFuture) for v in kwargs.values()):
        kwargs = {
            k: v.result() if isinstance(v, DeviceFuture) else v
            for k, v in kwargs.items()
        }
    return args, kwargs
