"""Materialize-once: a device output is copied to the host by one thread only."""

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Materializer(Generic[T]):
    """Runs a host materialization function at most once, on whichever thread
    calls get() first; the others wait for it and see the same result (or the
    same exception).

    The scheduler thread and the output thread may both reach for the same
    sampled tokens; the first to take the function makes the copy (and pays
    for it) once. The library lacks only that claim: a Future is the rest.
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._claim = threading.Lock()
        self._result: Future[T] = Future()

    def get(self) -> T:
        with self._claim:
            fn, self._fn = self._fn, None  # also drops captured device buffers
        if fn is not None:
            try:
                self._result.set_result(fn())
            except BaseException as exc:
                self._result.set_exception(exc)
        return self._result.result()

    def peek(self) -> T | None:
        """The result if some thread has materialized it (raising its
        exception if that failed), else None without waiting: a reader that
        only wants what is there already asks once."""
        if not self._result.done():
            return None
        return self._result.result()

    def is_materialized(self) -> bool:
        """True once the function ran, whether it succeeded or raised."""
        return self._result.done()
