"""Chunked prefill for devices that cannot mix prefill and decode in a batch.

Rules (Spyre's, docs/design.md section 2): a step is either one request's prefill
chunk or a decode batch; at most one prefill is ongoing and it beats new
requests; with interleaving a prefill step never follows a prefill step while
decodes wait; admission keeps ``max_num_seqs``, the volumetric tkv limit, and
KV blocks reserved for ``prompt + max_tokens``.

Run-ahead consistency: with async scheduling ``schedule()`` for step N+1 runs
before ``update_from_output()`` for step N. Every fact this mixin plans from is
therefore a *schedule-time* fact that vLLM updates when a step is scheduled,
not when its output lands: ``num_computed_tokens`` and ``is_prefill_chunk``
(advanced in ``_update_after_schedule``), ``num_output_placeholders`` (tokens
in flight), the blocks already allocated, and the kind of the last *scheduled*
step. Nothing is written in ``update_from_output``, so nothing can go stale.
"""

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.request import RequestStatus

from vllm_neuron_sched import envs
from vllm_neuron_sched.core.errors import ErrorFinishMixin
from vllm_neuron_sched.core.limits import RequestLimits
from vllm_neuron_sched.core.step_view import restricted_view

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class StepPlanKind(enum.Enum):
    """What the policy decided the next step is (not what a batch turned out
    to hold: that is ``step_view.BatchShape``)."""

    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"


@dataclass(frozen=True)
class StepPlan:
    kind: StepPlanKind
    # The request whose chunk a PREFILL step runs; None otherwise.
    prefill: "Request | None" = None


class ChunkedPrefillMixin(ErrorFinishMixin):
    """Policy over vLLM's ``Scheduler`` or ``AsyncScheduler`` (listed after it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.interleave_prefills = envs.VLLM_NEURON_SCHED_PREFILL_INTERLEAVING
        self.limits = RequestLimits.from_config(self.vllm_config)
        self.max_model_len = self.vllm_config.model_config.max_model_len
        # Kind of the last *scheduled* step (the device runs steps in that order).
        self.last_step_kind = StepPlanKind.IDLE

    # --- the step ---------------------------------------------------------

    def schedule(self, *args, **kwargs) -> "SchedulerOutput":
        plan = self.plan_step()
        if plan.kind is StepPlanKind.PREFILL:
            assert plan.prefill is not None
            if plan.prefill.status == RequestStatus.RUNNING:
                view = restricted_view(self, [plan.prefill], [])
            else:
                view = restricted_view(self, [], [plan.prefill])
        elif plan.kind is StepPlanKind.DECODE:
            view = restricted_view(self, self.decoding_requests(), [])
        else:
            view = restricted_view(self, [], [])
        with view:
            output = super().schedule(*args, **kwargs)
        self.last_step_kind = (
            plan.kind if output.num_scheduled_tokens else StepPlanKind.IDLE
        )
        return output

    def plan_step(self) -> StepPlan:
        """Prefill when allowed (TTFT), else decode, else nothing."""
        can_decode = any(self.can_schedule_decode(r) for r in self.decoding_requests())
        prefill = self.ongoing_prefill() or self.admissible_waiting_request()
        blocked_by_interleaving = (
            self.interleave_prefills
            and self.last_step_kind is StepPlanKind.PREFILL
            and can_decode
        )
        if prefill is not None and not blocked_by_interleaving:
            return StepPlan(StepPlanKind.PREFILL, prefill)
        if can_decode:
            return StepPlan(StepPlanKind.DECODE)
        return StepPlan(StepPlanKind.IDLE)

    # --- schedule-time views of the running set ------------------------------

    def ongoing_prefill(self) -> "Request | None":
        return next((r for r in self.running if r.is_prefill_chunk), None)

    def decoding_requests(self) -> list["Request"]:
        return [r for r in self.running if not r.is_prefill_chunk]

    def decode_tkv(self, requests: list["Request"] | None = None) -> int:
        """The decode batch's tkv: its largest position (the batch is
        rectangular, shorter rows left-padded), as of the last scheduled step."""
        batch = self.decoding_requests() if requests is None else requests
        return max((r.num_computed_tokens for r in batch), default=0)

    def can_schedule_decode(self, request: "Request") -> bool:
        """False when the in-flight steps already reach ``max_tokens``.

        The same test vLLM's scheduler applies before it schedules a running
        request; we need it up front to avoid planning an empty decode step.
        """
        return not (
            request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens
        )

    def remaining_tokens(self, request: "Request") -> int:
        """Output tokens the request may still be scheduled for."""
        produced = request.num_output_tokens + request.num_output_placeholders
        return max(0, request.max_tokens - produced)

    def blocks_needed(self, request: "Request") -> int:
        """KV blocks for the request's whole life: prompt + max_tokens."""
        num_tokens = min(
            request.num_prompt_tokens + request.max_tokens, self.max_model_len
        )
        return cdiv(num_tokens, self.block_size)

    def reserved_blocks(self) -> int:
        """Blocks promised to running requests but not allocated yet."""
        reserved = 0
        for request in self.running:
            allocated = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            reserved += max(0, self.blocks_needed(request) - len(allocated))
        return reserved

    # --- admission -----------------------------------------------------------

    def admissible_waiting_request(self) -> "Request | None":
        """The first ready waiting request, if it may start now.

        Served in order, those holding KV blocks first (as vLLM does); a
        request still compiling its grammar is passed over (vLLM's scheduler
        does the same) until the grammar is ready.
        """
        queued = itertools.chain(self.kv_holding_waiting, self.waiting)
        candidate = next(
            (r for r in queued if self._handle_blocked_waiting_request(r)), None
        )
        if candidate is None:
            return None
        if len(self.running) >= self.max_num_running_reqs:
            return None
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        if free - self.reserved_blocks() < self.blocks_needed(candidate):
            return None
        batch = [*self.decoding_requests(), candidate]
        tkv_after_join = max(candidate.num_tokens, self.decode_tkv(batch[:-1]))
        worst_tkv = tkv_after_join + max(self.remaining_tokens(r) for r in batch)
        if len(batch) * worst_tkv > self.limits.max_batch_tkv_limit:
            return None
        return candidate
