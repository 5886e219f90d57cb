"""Per-step host and device busy intervals of one worker, for the benchmarks.

``VLLM_NEURON_SCHED_TIMELINE=1`` subscribes a ``StepTimeline`` to the async
flow's events (off, nothing is timed). It records, per step (the
``execute_model`` call number):

- ``host``: ``execute_model`` and ``sample_tokens`` on the worker main thread,
  ``get_output`` on the executor's async output thread;
- ``wait``: a host thread blocked on a device result (nested in ``host``);
- ``device``: one device execution, start to end, on the thread that ran it
  (the device thread; the main thread for an inline device, nested in
  ``host``), tagged with the step that enqueued it.

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: comparable
across the processes of one machine). Read with
``LLM.collective_rpc("get_step_timeline")``.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm_neuron_sched import envs
from vllm_neuron_sched.worker.async_flow import FlowObserver

HOST, WAIT, DEVICE = "host", "wait", "device"


@dataclass(frozen=True, slots=True)
class Interval:
    kind: str  # HOST | WAIT | DEVICE
    name: str  # e.g. "execute_model", "tp0:NeuronSchedModelRunner._forward..."
    step: int  # execute_model call number that this work belongs to
    thread: str  # thread name
    start: float  # perf_counter seconds
    end: float


@dataclass(frozen=True, slots=True)
class StepInfo:
    step: int
    start: float  # perf_counter at execute_model entry
    num_reqs: int  # requests scheduled
    num_tokens: int  # tokens scheduled (== num_reqs for a pure decode step)


class StepTimeline(FlowObserver):
    """A bounded, thread-safe (append-only deques) record of recent steps."""

    is_timed = True

    def __init__(self, max_intervals: int = 200_000) -> None:
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self.steps: deque[StepInfo] = deque(maxlen=max_intervals // 4)

    @classmethod
    def from_env(cls) -> "StepTimeline | None":
        return cls() if envs.VLLM_NEURON_SCHED_TIMELINE else None

    def snapshot(self, clear: bool = False) -> dict[str, Any]:
        """Plain lists (cheap to send over the executor's RPC)."""
        result = {
            "clock": "perf_counter",
            "steps": [list(_astuple(s)) for s in list(self.steps)],
            "intervals": [list(_astuple(i)) for i in list(self.intervals)],
        }
        if clear:
            self.steps.clear()
            self.intervals.clear()
        return result

    # ---- FlowObserver --------------------------------------------------------

    def step_began(self, step: int, scheduler_output: Any) -> None:
        self.steps.append(
            StepInfo(
                step,
                time.perf_counter(),
                len(scheduler_output.num_scheduled_tokens),
                scheduler_output.total_num_scheduled_tokens,
            )
        )

    def host_work(self, name: str, step: int, start: float, end: float) -> None:
        self._add(HOST, name, step, start, end)

    def waited(self, step: int, start: float, end: float) -> None:
        self._add(WAIT, "device_result", step, start, end)

    def executed(self, label: str, step: int, start: float, end: float) -> None:
        self._add(DEVICE, label, step, start, end)

    def _add(self, kind: str, name: str, step: int, start: float, end: float) -> None:
        thread = threading.current_thread().name
        self.intervals.append(Interval(kind, name, step, thread, start, end))


def _astuple(record: Interval | StepInfo) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in record.__slots__)
