"""The async flow: the steps in flight on the device, and when they retire.

Every sampling step leaves its tokens on the device twice over: in its own
result (which the engine reads back later, on the executor's output thread)
and in the device token table (``token_table.py``), from which later steps'
decode rows take their input ids. Only prompt tokens come from the host.

Host state (``host_state.py``) learns the tokens when a step *retires*: its
output fills the request histories' placeholders at the start of a later step,
once the engine has read that output (the batch queue is two deep with async
scheduling, as deep as the pipeline with pipeline parallel: by then it
has). Each step ends in one of three states, counted by *structure*, not by
timing, so the counts are the same on every backend however fast its
device is:

- ``ASYNC``: the step enqueued work, its decode rows took their input ids
  from the token table, and the host needed no device result the engine had
  not read yet;
- ``HOST_INPUTS``: no decode row read the table (prompt chunks, whose tokens
  are on the host anyway) and no such result was needed;
- ``SYNC_FALLBACK``: before the step returned to the engine, the host needed
  a device result the engine had not read: sync mode's own output, a step
  two back still unread, or a prompt position whose token is still only on
  the device. Each such read is also a *host wait* (``host_waits``), as is a
  read ahead of the engine outside a step (an RPC such as ``get_rank_state``
  that drains the flow).

"The engine has read" a step: on the output rank, its output was
materialized (the executor's output thread, or the engine thread in-process,
called ``get_output``); on the other TP ranks, whose outputs nobody reads,
the batch queue's depth bounds it: when step N arrives, the engine has
processed every step up to N - depth. So up to depth - 1 steps stay in flight
at the start of a step. Sampling never reads the host's histories: the
device keeps its own (``sampling_state.py``).

Threads: the worker's main thread owns this object. The device thread only
runs the executions the main thread enqueues. The executor's output thread
only materializes outputs (``InFlightStep.output``), which touches no host
state.
"""

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import AsyncModelRunnerOutput

from vllm_neuron_sched.core.step_view import BatchShape

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_neuron_sched.runtime import Device, DeviceFuture, Materializer
    from vllm_neuron_sched.worker.host_state import (
        HostRequestState,
        Placeholders,
        StepUpdate,
    )


class StepState(Enum):
    ASYNC = "async"
    HOST_INPUTS = "host inputs"
    SYNC_FALLBACK = "sync fallback"


@dataclass
class InFlightStep:
    """A step whose output the engine may not have read yet (and whose
    sampled tokens are not all in host state yet)."""

    number: int  # the step (execute_model call) that enqueued it
    # The step's last execution: sampling, or the forward of a step whose
    # rows all run prompt chunks that are not their last.
    result: "DeviceFuture[Any]"
    output: "Materializer[ModelRunnerOutput]"
    # The sampling rows' placeholders, filled when the step retires.
    placeholders: "Placeholders" = field(default_factory=dict)

    def is_materialized(self) -> bool:
        """Some thread has turned the output into host data."""
        return self.output.is_materialized()

    def is_ready(self) -> bool:
        """Reading the output now would not wait for the device (timing)."""
        return self.is_materialized() or self.result.done()


class FlowObserver:
    """Subscribes to the flow's events (each a no-op here). Called on the
    thread where the event happens; must be cheap and must not block."""

    is_timed = False  # True: wants host_work / waited / executed intervals

    def step_began(self, step: int, scheduler_output: "SchedulerOutput") -> None:
        """Main thread, at the start of ``execute_model``."""

    def host_work(self, name: str, step: int, start: float, end: float) -> None:
        """A host thread's share of a step (perf_counter seconds)."""

    def waited(self, step: int, start: float, end: float) -> None:
        """A host thread blocked on a device result."""

    def executed(self, label: str, step: int, start: float, end: float) -> None:
        """One device execution, on the thread that ran it."""

    def step_ended(self, step: int, state: StepState) -> None:
        """Main thread: how a step that enqueued work was classified."""

    def requests_finished(self, finished: "list[tuple[str, list[int]]]") -> None:
        """Main thread: requests that left, each with its history, which may
        still end in placeholders, filled as the steps that sampled them
        retire."""


class AsyncFlow:
    """``host``: where a retired step's tokens go. ``is_output_rank``: the
    engine reads this worker's outputs (TP rank 0 of the last stage).
    ``queue_depth``: steps the engine keeps in flight (vLLM's
    ``max_concurrent_batches`` with async scheduling: 2, or the pipeline's
    stages; 1 without)."""

    def __init__(
        self,
        device: "Device",
        host: "HostRequestState",
        is_output_rank: bool = True,
        queue_depth: int = 2,
    ) -> None:
        self.device = device
        self.host = host
        self.is_output_rank = is_output_rank
        self.queue_depth = queue_depth
        self.in_flight: deque[InFlightStep] = deque()
        self.max_in_flight = 0
        self.step = 0
        # The current step needed a device result the engine had not read.
        self._needed_unread = False
        self._observers: list[FlowObserver] = []
        # The observers that want timings (``is_timed``); none: nothing is
        # timed.
        self.timed: list[FlowObserver] = []
        self.async_steps = 0
        self.sync_fallback_steps = 0
        self.prefill_steps = 0
        # Reads of a device result ahead of the engine, in a step or not.
        self.host_waits = 0
        # Tokens computed for requests that had already stopped.
        self.dead_tokens = 0

    def subscribe(self, observer: FlowObserver) -> None:
        self._observers.append(observer)
        if observer.is_timed:
            self.timed.append(observer)
            self.device.on_execution = self._executed

    def unsubscribe(self, observer: FlowObserver) -> None:
        self._observers.remove(observer)
        if observer in self.timed:
            self.timed.remove(observer)
            if not self.timed:
                self.device.on_execution = None

    # ---- one step, main thread ---------------------------------------------

    def begin_step(self, scheduler_output: "SchedulerOutput") -> "StepUpdate":
        """Brings host state to this step: retires every step but the newest
        (their outputs were read by now), then applies the scheduler's
        decisions; counts the dead tokens of requests that stopped."""
        self.step += 1
        self.device.tag = self.step
        self._needed_unread = False
        for observer in self._observers:
            observer.step_began(self.step, scheduler_output)
        if finished := scheduler_output.finished_req_ids:
            # The steps after the one whose output stopped them (with a full
            # batch queue, the depth - 1 before this one) were scheduled
            # before the engine knew.
            for step in self.in_flight:
                if step.number > self.step - self.queue_depth:
                    self.dead_tokens += len(finished & step.placeholders.keys())
        # Every step but the depth - 1 newest: their outputs were read by now.
        num_retired = max(0, len(self.in_flight) - (self.queue_depth - 1))
        retired = [self._pop_oldest() for _ in range(num_retired)]
        update = self.host.update(scheduler_output, retired)
        if update.finished:
            for observer in self._observers:
                observer.requests_finished(update.finished)
        return update

    def end_step(
        self, step: InFlightStep, shape: BatchShape, num_table_rows: int
    ) -> "ModelRunnerOutput | AsyncStepOutput":
        """Puts a step that enqueued work in flight, classifies it
        (``num_table_rows``: decode rows whose input ids the forward reads
        from the token table) and returns its output to the engine: with the
        batch queue (depth > 1) a future the engine reads later, else the
        output itself, read now."""
        self.in_flight.append(step)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        output: ModelRunnerOutput | AsyncStepOutput
        if self.queue_depth > 1:
            output = AsyncStepOutput(self, step)
        else:
            self.retire(keep=1)
            output = self._retire_oldest()
        if self._needed_unread:
            state = StepState.SYNC_FALLBACK
            self.sync_fallback_steps += 1
        elif num_table_rows:
            state = StepState.ASYNC
            self.async_steps += 1
        else:
            state = StepState.HOST_INPUTS
        if shape is BatchShape.PREFILL:
            self.prefill_steps += 1
        for observer in self._observers:
            observer.step_ended(self.step, state)
        return output

    def retire(self, keep: int = 0) -> None:
        """Applies steps to host state, oldest first, until at most ``keep``
        are left. A step read before the engine has is a host wait."""
        while len(self.in_flight) > keep:
            self._retire_oldest()

    def retire_ready(self) -> None:
        """Applies the steps whose device results are there already: in a
        step that enqueues nothing, so an idle worker holds no step it need
        not. Nothing needs these results now, so it is no host wait."""
        while self.in_flight and self.in_flight[0].is_ready():
            self._retire_oldest(is_needed=False)

    def drain(self) -> None:
        """Every step into host state, outside a step (an RPC): a read ahead
        of the engine counts as a host wait, not against any step."""
        self.retire()
        self._needed_unread = False

    def read(self, step: InFlightStep, is_needed: bool = True) -> "ModelRunnerOutput":
        """The step's output on the main thread. Needed ahead of the engine,
        it is a host wait, whether or not the device happens to be done."""
        # Whether the engine has read it (see the module docstring).
        if self.is_output_rank:
            output = step.output.peek()  # there once the engine has read it
            if output is not None:
                return output
        elif step.number <= self.step - self.queue_depth:
            return step.output.get()
        if is_needed:
            self.host_waits += 1
            self._needed_unread = True
        if not self.timed or step.result.done():
            return step.output.get()
        start = time.perf_counter()
        try:
            return step.output.get()
        finally:
            self._report_wait(start)

    def _pop_oldest(
        self, is_needed: bool = True
    ) -> "tuple[Placeholders, ModelRunnerOutput]":
        step = self.in_flight[0]
        output = self.read(step, is_needed)
        self.in_flight.popleft()
        return step.placeholders, output

    def _retire_oldest(self, is_needed: bool = True) -> "ModelRunnerOutput":
        placeholders, output = self._pop_oldest(is_needed)
        self.host.fill_placeholders([(placeholders, output)])
        return output

    def stats(self) -> dict[str, int]:
        return {
            "async_steps": self.async_steps,
            "sync_fallback_steps": self.sync_fallback_steps,
            "prefill_steps": self.prefill_steps,
            "host_waits": self.host_waits,
            "dead_tokens": self.dead_tokens,
        }

    # ---- timing, for timed observers ---------------------------------------

    @contextmanager
    def host_section(self, name: str, step: int | None = None) -> Iterator[None]:
        """Reports the section to the timed observers; callers enter it only
        when there are some (``timed``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            for observer in self.timed:
                observer.host_work(
                    name, self.step if step is None else step, start, end
                )

    def output_read(self, step: InFlightStep) -> "ModelRunnerOutput":
        """The output thread's read of a step (``AsyncStepOutput``)."""
        if not self.timed:
            return step.output.get()
        if not step.is_ready():
            start = time.perf_counter()
            _wait_quietly(step.result)
            self._report_wait(start, step.number)
        with self.host_section("get_output", step.number):
            return step.output.get()

    def _report_wait(self, start: float, step: int | None = None) -> None:
        end = time.perf_counter()
        for observer in self.timed:
            observer.waited(self.step if step is None else step, start, end)

    def _executed(self, label: str, tag: int, start: float, end: float) -> None:
        for observer in self.timed:
            observer.executed(label, tag, start, end)


def _wait_quietly(future: "DeviceFuture[Any]") -> None:
    """Waits for a device result; a failure surfaces where it is read."""
    with suppress(Exception):
        future.result()


class AsyncStepOutput(AsyncModelRunnerOutput):
    """A step's output in async mode. ``get_output()`` runs on the executor's
    async output thread (output rank) or the engine thread (uniproc); it only
    turns the device result into host lists."""

    def __init__(self, flow: AsyncFlow, step: InFlightStep) -> None:
        self._flow = flow
        self._step = step

    def get_output(self) -> "ModelRunnerOutput":
        return self._flow.output_read(self._step)
