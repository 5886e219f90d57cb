"""The async flow: the one owner of what is on the device.

Every sampling step leaves its tokens on the device twice over: in its own
result (which the engine reads back later, on the executor's output thread)
and in the *device token table*, one entry per live request (its token slot),
written by the sampling execution itself. A later step's decode rows read
their input ids from that table, on the device. So step N's tokens are step
N+1's input ids without a host round trip whatever happens to the batch in
between: requests joining after their prefill, finishing, aborted, reordered,
prompt chunks of other requests running in between. Only prompt tokens come
from the host.

Host state learns the tokens when a step *retires*: its output is applied to
the request histories (placeholders filled) at the start of a later step,
which never waits in steady state because the engine has already read that
output (the batch queue is two deep). Each step ends in one of three states
(the counters count them):

- ``ASYNC``: a step with decode rows whose main thread never waited for the
  device (steady-state async, whatever the batch composition);
- ``HOST_INPUTS``: prompt chunks only, whose tokens are on the host anyway;
- ``SYNC_FALLBACK``: the main thread waited for a device result during the
  step. Sync mode does this every step; async mode only where host state is
  needed before the device has produced it (a step two back not read yet,
  e.g. on a TP rank the engine never reads, or an RPC such as
  ``get_rank_state``).

Threads: the worker's main thread owns this object. The device thread only
runs the executions the main thread enqueues; they alone read and write the
token table (``DeviceTokens``). The executor's output thread only
materializes outputs (``InFlightStep.output``), which touches no host state.
"""

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_neuron_sched.core.step_view import BatchShape

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_neuron_sched.runtime import DeviceFuture, Materializer
    from vllm_neuron_sched.runtime.device import Device


class StepState(Enum):
    ASYNC = "async"
    HOST_INPUTS = "host inputs"
    SYNC_FALLBACK = "sync fallback"


# Slot 0 of the token table is the padding slot: padded and non-sampling rows
# write there, and nothing real reads it.
PAD_SLOT = 0


class DeviceTokens:
    """The newest sampled token of every live request, on the device.

    The host assigns and frees slots; only device executions touch the table
    (``read`` in a forward, ``write`` after sampling, in enqueue order), so the
    host never reads, writes or resizes storage an execution may be using.
    """

    def __init__(self, capacity: int) -> None:
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(capacity, 0, -1))
        self._capacity = capacity
        self._table = torch.zeros(capacity + 1, dtype=torch.int32)  # device-owned

    def assign(self, req_id: str, device: "Device") -> int:
        """A slot for a request joining the batch (kept until ``release``)."""
        if (slot := self._slot_of.get(req_id)) is not None:
            return slot
        if not self._free:
            # More live requests than ever (preempted ones wait with their
            # slot): the table grows on the device, after what is queued.
            new_capacity = 2 * self._capacity
            self._free = list(range(new_capacity, self._capacity, -1))
            self._capacity = new_capacity
            device.enqueue(self._grow, new_capacity + 1)
        slot = self._slot_of[req_id] = self._free.pop()
        return slot

    @property
    def capacity(self) -> int:
        """Slots the table has (the padding slot aside)."""
        return self._capacity

    def release(self, req_id: str) -> None:
        if (slot := self._slot_of.pop(req_id, None)) is not None:
            self._free.append(slot)

    def slots(self, req_ids: list[str] | tuple[str, ...]) -> np.ndarray:
        return np.fromiter(
            (self._slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )

    # ---- device side: called inside device executions only ----------------

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self._table[slots]

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._table[slots] = tokens

    def _grow(self, size: int) -> None:
        table = torch.zeros(size, dtype=torch.int32)
        table[: self._table.shape[0]] = self._table
        self._table = table


@dataclass
class InFlightStep:
    """A sampling step whose tokens are not all in host state yet."""

    number: int  # the step (execute_model call) that enqueued it
    req_ids: tuple[str, ...]
    result: "DeviceFuture[Any]"  # the sampling execution
    output: "Materializer[ModelRunnerOutput]"
    # req_id -> (the request's output_token_ids, index of its placeholder);
    # the list is held here so a finished request's history is completed too.
    placeholders: dict[str, tuple[list[int], int]] = field(default_factory=dict)

    def is_read(self) -> bool:
        """The engine has its output (the output thread read it)."""
        return self.output.is_materialized()

    def is_ready(self) -> bool:
        """Reading the output now would not wait for the device."""
        return self.is_read() or self.result.done()


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

    def retired(self, step: InFlightStep) -> None:
        """Main thread: the step's tokens are now in host state."""

    def request_finished(self, req_id: str, history: list[int]) -> None:
        """Main thread: the request left; ``history`` may still end in
        placeholders, filled as the steps that sampled them retire."""


class AsyncFlow:
    def __init__(self, device: "Device", capacity: int, apply: Any) -> None:
        self.device = device
        self.tokens = DeviceTokens(capacity)
        # Applies a retired step's tokens to host state (the runner's).
        self._apply = apply
        self.in_flight: deque[InFlightStep] = deque()
        self.max_in_flight = 0
        self.step = 0
        self.state: StepState | None = None
        self._has_waited = False
        self._observers: list[FlowObserver] = []
        self._timed: list[FlowObserver] = []
        self.async_steps = 0
        self.sync_fallback_steps = 0
        self.prefill_steps = 0
        # Tokens computed for requests that had already stopped.
        self.dead_tokens = 0

    def subscribe(self, observer: FlowObserver) -> None:
        self._observers.append(observer)
        if observer.is_timed:
            self._timed.append(observer)
            self.device.on_execution = self._executed

    def unsubscribe(self, observer: FlowObserver) -> None:
        self._observers.remove(observer)
        if observer in self._timed:
            self._timed.remove(observer)
            if not self._timed:
                self.device.on_execution = None

    # ---- one step, main thread ---------------------------------------------

    def begin_step(self, scheduler_output: "SchedulerOutput") -> None:
        """Retires every step but the newest (their outputs were read by now);
        counts the dead tokens of requests that stopped."""
        self.step += 1
        self.device.tag = self.step
        self._has_waited = False
        for observer in self._observers:
            observer.step_began(self.step, scheduler_output)
        if (finished := scheduler_output.finished_req_ids) and self.in_flight:
            # The step before this one was scheduled before they stopped.
            previous = self.in_flight[-1]
            if previous.number == self.step - 1:
                self.dead_tokens += len(finished & previous.placeholders.keys())
        self.retire(keep_newest=True)

    def finish_request(self, req_id: str, history: list[int]) -> None:
        """The request stopped or was aborted: its slot is free for the next
        request (an enqueued step may still write it; a new owner's writes
        and reads come after, in device order)."""
        self.tokens.release(req_id)
        for observer in self._observers:
            observer.request_finished(req_id, history)

    def push(self, step: InFlightStep) -> None:
        self.in_flight.append(step)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def end_step(self, shape: BatchShape, is_sync: bool = False) -> StepState:
        """``is_sync``: the step handed its host tokens back before the next
        step (sync mode), a wait whether or not the device had finished."""
        if self._has_waited or is_sync:
            self.state = StepState.SYNC_FALLBACK
            self.sync_fallback_steps += 1
        elif shape is BatchShape.PREFILL:
            self.state = StepState.HOST_INPUTS
        else:
            self.state = StepState.ASYNC
            self.async_steps += 1
        if shape is BatchShape.PREFILL:
            self.prefill_steps += 1
        return self.state

    def retire(self, keep_newest: bool = False) -> None:
        """Applies steps to host state, oldest first. Steps before the newest
        are read even if that waits (the engine has read them by now, except
        on TP ranks whose outputs nobody reads); with ``keep_newest`` the
        newest only once the engine has read it, so two steps are in flight
        as the batch queue has them."""
        while self.in_flight:
            step = self.in_flight[0]
            if keep_newest and len(self.in_flight) == 1 and not step.is_read():
                return
            self.wait_for(step)
            self.in_flight.popleft()
            self._apply(step)
            for observer in self._observers:
                observer.retired(step)

    def wait_for(self, step: InFlightStep) -> "ModelRunnerOutput":
        """The step's output on the main thread; a wait counts against the
        current step."""
        if step.is_ready():
            return step.output.get()
        self._has_waited = True
        start = time.perf_counter()
        try:
            return step.output.get()
        finally:
            self._report_wait(start)

    def stats(self) -> dict[str, int]:
        return {
            "async_steps": self.async_steps,
            "sync_fallback_steps": self.sync_fallback_steps,
            "prefill_steps": self.prefill_steps,
            "dead_tokens": self.dead_tokens,
        }

    # ---- timing, for timed observers ---------------------------------------

    @contextmanager
    def host_section(self, name: str, step: int | None = None) -> Iterator[None]:
        if not self._timed:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            for observer in self._timed:
                observer.host_work(
                    name, self.step if step is None else step, start, end
                )

    def output_read(self, step: InFlightStep) -> "ModelRunnerOutput":
        """The output thread's read of a step (``AsyncStepOutput``)."""
        if not self._timed:
            return step.output.get()
        if not step.is_ready():
            start = time.perf_counter()
            _wait_quietly(step.result)
            self._report_wait(start, step.number)
        with self.host_section("get_output", step.number):
            return step.output.get()

    def _report_wait(self, start: float, step: int | None = None) -> None:
        end = time.perf_counter()
        for observer in self._timed:
            observer.waited(self.step if step is None else step, start, end)

    def _executed(self, label: str, tag: int, start: float, end: float) -> None:
        for observer in self._timed:
            observer.executed(label, tag, start, end)


def _wait_quietly(future: "DeviceFuture[Any]") -> None:
    """Waits for a device result; a failure surfaces where it is read."""
    with suppress(Exception):
        future.result()
