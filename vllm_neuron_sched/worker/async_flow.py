"""The async flow: feed step N's sampled-token future to step N+1 on the device.

One small state machine, the flow of ``seeds/neuron-async-scheduling-design.txt``
(DESIGN.md section 6). Per step the runner calls, in order:

1. ``guard(scheduled_req_ids)`` before it updates any host state. If the set
   of scheduled requests differs from the set that produced the pending
   future, we *break the async flow*: the pending output is materialized on the
   critical path, so the state update sees every sampled token.
2. ``choose_input_ids(...)`` after host inputs are built. In *steady-state
   async* (a decode step, same requests, same padded shape) the pending future
   becomes the step's input_ids: no host read. A same-set reorder remaps the
   future (a *sync fallback*: its rows are gathered, not fed as-is). A shape or
   dtype mismatch materializes and asks the runner to rebuild host inputs.
3. ``reinstate(pending)`` at the end of every step, with the step's own
   sampled-token future (None when the step sampled nothing).

The flow knows nothing of tensors or threads: ``materialize`` is the runner's
callback that waits for a pending output and applies it to host state on the
calling (main) thread.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class StepKind(Enum):
    DECODE = "decode"  # every request decodes one token
    PREFILL = "prefill"  # no request decodes: prompt chunks only
    MIXED = "mixed"  # both (only a user's scheduler makes these)


class FlowState(Enum):
    NO_FUTURE = "no future"  # nothing pending: first step, after a no-sample step
    STEADY_ASYNC = "steady-state async"  # input_ids = the previous step's future
    SYNC_FALLBACK = "sync fallback"  # broke the async flow: host-built or remapped
    HOST_INPUTS = "host inputs"  # a prefill step: its tokens come from the host


@dataclass
class PendingStep:
    """What the latest sampling step left on the device."""

    # Row order that produced ``tokens``: rows i < len(req_ids) are real.
    req_ids: tuple[str, ...]
    # Device future of the sampled tokens, [num_rows_padded] (padded rows 0).
    tokens: Any
    # Padded row count and dtype of ``tokens``: what the next step must match.
    num_rows_padded: int
    dtype: Any


@dataclass(frozen=True)
class InputChoice:
    """Where the step's input_ids come from."""

    # The device future to use as input_ids; None: use the host-built ones.
    tokens: Any = None
    # Same-set reorder: input row i takes row ``row_map[i]`` of ``tokens``.
    row_map: tuple[int, ...] | None = None
    # Host inputs were stale (the pending output was materialized): rebuild them.
    must_rebuild: bool = False

    @property
    def uses_future(self) -> bool:
        return self.tokens is not None


HOST = InputChoice()
REBUILD = InputChoice(must_rebuild=True)


class AsyncFlow:
    def __init__(self, materialize: Callable[[PendingStep], None]) -> None:
        self._materialize = materialize
        self._pending: PendingStep | None = None
        self._is_composition_changed = False
        self.state = FlowState.NO_FUTURE
        # Decode steps whose input_ids were the previous step's future, as is.
        self.async_steps = 0
        # Decode (or mixed) steps that broke the flow: host-built or remapped.
        self.sync_fallback_steps = 0
        # Prefill-only steps: host inputs by nature, neither async nor fallback.
        self.prefill_steps = 0

    @property
    def pending(self) -> PendingStep | None:
        return self._pending

    def guard(self, scheduled_req_ids: Iterable[str]) -> bool:
        """Before the state update: break the flow if the request set changed.

        A set comparison catches every cause at once (finished, new, resumed,
        unscheduled, the max_tokens gap where a request leaves
        num_scheduled_tokens a step before it is listed as finished).
        """
        pending = self._pending
        self._is_composition_changed = pending is not None and frozenset(
            scheduled_req_ids
        ) != frozenset(pending.req_ids)
        if self._is_composition_changed:
            assert pending is not None
            self._materialize(pending)
        return self._is_composition_changed

    def choose_input_ids(
        self,
        req_ids: Sequence[str],
        kind: StepKind,
        num_rows_padded: int,
        dtype: Any,
        host_has_placeholders: bool,
    ) -> InputChoice:
        """After host inputs are built: the future, a remap, or host inputs.

        ``host_has_placeholders``: some real host input is a token still on the
        device (a placeholder); host inputs are then only usable once the
        pending output is materialized and the inputs rebuilt.
        """
        pending = self._pending
        if (
            kind is not StepKind.DECODE
            or pending is None
            or self._is_composition_changed
        ):
            is_prefill = kind is StepKind.PREFILL
            self._enter(
                FlowState.HOST_INPUTS if is_prefill else FlowState.SYNC_FALLBACK
            )
            is_stale = host_has_placeholders and not self._is_composition_changed
            if pending is not None and is_stale:
                # E.g. a mixed step (a user's scheduler) reads a device token.
                self._materialize(pending)
                return REBUILD
            return HOST
        if pending.num_rows_padded != num_rows_padded or pending.dtype != dtype:
            self._materialize(pending)
            self._enter(FlowState.SYNC_FALLBACK)
            return REBUILD
        if tuple(req_ids) != pending.req_ids:
            row_of = {req_id: row for row, req_id in enumerate(pending.req_ids)}
            self._enter(FlowState.SYNC_FALLBACK)
            return InputChoice(
                tokens=pending.tokens, row_map=tuple(row_of[r] for r in req_ids)
            )
        self._enter(FlowState.STEADY_ASYNC)
        return InputChoice(tokens=pending.tokens)

    def reinstate(self, pending: PendingStep | None) -> None:
        """End of every step: the step's own future is the next step's input."""
        self._pending = pending
        self._is_composition_changed = False

    def stats(self) -> dict[str, int]:
        return {
            "async_steps": self.async_steps,
            "sync_fallback_steps": self.sync_fallback_steps,
            "prefill_steps": self.prefill_steps,
        }

    def _enter(self, state: FlowState) -> None:
        self.state = state
        if state is FlowState.STEADY_ASYNC:
            self.async_steps += 1
        elif state is FlowState.SYNC_FALLBACK:
            self.sync_fallback_steps += 1
        elif state is FlowState.HOST_INPUTS:
            self.prefill_steps += 1
