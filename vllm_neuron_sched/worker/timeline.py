"""Per-step host and device busy intervals of one worker, for the benchmarks.

``VLLM_NEURON_SCHED_TIMELINE=1`` turns it on; off, the runner holds ``None``
and nothing is wrapped, so it costs nothing. On, ``instrument`` wraps the
runner's and the device's methods on the instances (the classes stay as they
are) and records, per step (the ``execute_model`` call number):

- ``host``: ``execute_model``, ``sample_tokens`` and ``materialize`` (host
  state from a device result) on the worker main thread, ``get_output`` on
  the executor's async output thread;
- ``wait``: a host thread blocked on a device result (on the main thread,
  nested in ``host``);
- ``device``: one device execution, start to end, on the device thread,
  tagged with the step that enqueued it.

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: comparable
across the processes of one machine). Read with
``LLM.collective_rpc("get_step_timeline")``.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import AsyncModelRunnerOutput

from vllm_neuron_sched import envs

if TYPE_CHECKING:
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_neuron_sched.runtime.device import Device, Execution

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


class StepTimeline:
    """A bounded, thread-safe (append-only deques) record of recent steps."""

    def __init__(self, max_intervals: int = 200_000) -> None:
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self.steps: deque[StepInfo] = deque(maxlen=max_intervals // 4)
        self.step = 0

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

    @contextmanager
    def record(self, kind: str, name: str, step: int | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.intervals.append(
                Interval(
                    kind,
                    name,
                    self.step if step is None else step,
                    threading.current_thread().name,
                    start,
                    time.perf_counter(),
                )
            )

    def instrument(self, runner: Any) -> None:
        """Wraps the runner's step entry points and its device."""
        execute_model = runner.execute_model
        sample_tokens = runner.sample_tokens
        apply_sampled_tokens = runner._apply_sampled_tokens

        def timed_execute_model(scheduler_output: Any, *args: Any) -> Any:
            self.step += 1
            self.steps.append(
                StepInfo(
                    self.step,
                    time.perf_counter(),
                    len(scheduler_output.num_scheduled_tokens),
                    scheduler_output.total_num_scheduled_tokens,
                )
            )
            with self.record(HOST, "execute_model"):
                return execute_model(scheduler_output, *args)

        def timed_sample_tokens(grammar_output: Any) -> Any:
            with self.record(HOST, "sample_tokens"):
                output = sample_tokens(grammar_output)
            if isinstance(output, AsyncModelRunnerOutput):
                ready = runner._in_flight[-1].next_input_ids
                return _TimedAsyncOutput(output, ready, self, self.step)
            return output

        def timed_apply_sampled_tokens(step: Any) -> None:
            with self.record(HOST, "materialize"):
                if not step.next_input_ids.done():
                    with self.record(WAIT, "device_result"):
                        _wait_quietly(step.next_input_ids)
                apply_sampled_tokens(step)

        runner.execute_model = timed_execute_model
        runner.sample_tokens = timed_sample_tokens
        runner._apply_sampled_tokens = timed_apply_sampled_tokens
        self.instrument_device(runner.accelerator)

    def instrument_device(self, device: "Device") -> None:
        """Tags each execution with the step that enqueues it and records its
        run (including simulated latency) on whichever thread runs it."""
        submit: Callable[[Execution], None] = device._submit
        execute: Callable[[Execution], None] = device._execute

        def tagged_submit(execution: "Execution") -> None:
            execution.timeline_step = self.step  # type: ignore[attr-defined]
            submit(execution)

        def timed_execute(execution: "Execution") -> None:
            step = getattr(execution, "timeline_step", self.step)
            with self.record(DEVICE, execution.future._label, step):
                execute(execution)

        device._submit = tagged_submit  # type: ignore[method-assign]
        device._execute = timed_execute  # type: ignore[method-assign]


class _TimedAsyncOutput(AsyncModelRunnerOutput):
    """Records the output thread's materialization of one step: its wait for
    the device result, then the host work."""

    def __init__(
        self,
        output: AsyncModelRunnerOutput,
        ready: Any,
        timeline: StepTimeline,
        step: int,
    ) -> None:
        self._output = output
        self._ready = ready  # device future done when the step's result is
        self._timeline = timeline
        self._step = step

    def get_output(self) -> "ModelRunnerOutput":
        if not self._ready.done():
            with self._timeline.record(WAIT, "device_result", self._step):
                _wait_quietly(self._ready)
        with self._timeline.record(HOST, "get_output", self._step):
            return self._output.get_output()


def _wait_quietly(future: Any) -> None:
    """Waits for a device future; a failure surfaces later, where it is read."""
    with suppress(Exception):
        future.result()


def _astuple(record: Interval | StepInfo) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in record.__slots__)
