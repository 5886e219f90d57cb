"""Materialize-once: a device output is copied to the host by one thread only."""

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Materializer(Generic[T]):
    """Runs a host materialization function at most once, whichever thread
    calls get() first; others block and see the same result (or same exception).

    The scheduler thread and the output thread may both reach for the same
    sampled tokens; a per-object lock keeps the copy (and its cost) single.
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._lock = threading.Lock()
        self._is_done = False
        self._value: T | None = None
        self._exception: BaseException | None = None

    def get(self) -> T:
        if not self._is_done:
            with self._lock:
                if not self._is_done:
                    self._run()
        if self._exception is not None:
            raise self._exception
        return self._value  # type: ignore[return-value]

    def is_materialized(self) -> bool:
        """True once the function ran, whether it succeeded or raised."""
        return self._is_done

    def _run(self) -> None:
        fn, self._fn = self._fn, None  # drop captured device buffers once run
        assert fn is not None
        try:
            self._value = fn()
        except BaseException as exc:
            self._exception = exc
        finally:
            self._is_done = True
