"""Futures for device outputs: where the host reads results, and errors, back.

``DeviceFuture`` is a ``concurrent.futures.Future``: waiting, timeouts, done
callbacks and the single completion are the library's. It adds a label and
errors chained to the device-side exception."""

from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class DeviceExecutionError(RuntimeError):
    """A device execution failed; ``__cause__`` holds the device-side exception
    (with its traceback), so the host sees where it really went wrong."""


class DeviceStateError(DeviceExecutionError):
    """An execution that updates state later executions rely on (the KV
    cache, the token table) failed, so the device state is unknown: every
    later execution fails with this error, chained to the first failure."""


class DeviceShutdownError(RuntimeError):
    """An enqueue on a device that was shut down."""


class DeviceFuture(Future[T]):
    """Output of one device execution; reading it on the host blocks until done.

    Running from the start (``set_running_or_notify_cancel``): an enqueued
    execution cannot be withdrawn, so ``cancel()`` returns False and only the
    backend completes the future, once.
    """

    def __init__(self, label: str = "execution") -> None:
        super().__init__()
        self.label = label  # "<device label>:<function>", for errors and logs
        self.set_running_or_notify_cancel()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DeviceFuture {self.label!r} {state}>"

    def result(self, timeout: float | None = None) -> T:
        """Blocks until done (``TimeoutError`` after ``timeout`` s); a device
        failure is raised as ``DeviceExecutionError`` chained from the
        original exception, a ``DeviceStateError`` as it is."""
        exc = self.exception(timeout)
        if exc is None:
            return super().result()
        if isinstance(exc, DeviceStateError):
            raise exc
        raise DeviceExecutionError(f"{self.label} failed: {exc!r}") from exc
