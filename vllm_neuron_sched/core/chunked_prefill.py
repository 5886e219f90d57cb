"""Chunked prefill for devices that cannot mix prefill and decode in a batch.

Rules (docs/design.md section 2): a step is either a prefill step or a decode
batch, never both. A prefill step runs the next chunk of several requests at
one static prefill shape (a packed row or ``rows x tokens per row``,
core/prefill_shapes.py): the ongoing prefills first, then waiting requests
in arrival order, as far as each can be admitted together with those before
it. With interleaving, a prefill step never follows a prefill step while
decodes wait. Admission keeps
``max_num_seqs``, the volumetric tkv limit, and KV blocks reserved for
``prompt + max_tokens`` (plus the drafts' lookahead when the engine
speculates), for the whole group.

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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.request import RequestStatus

from vllm_neuron_sched import envs
from vllm_neuron_sched.core.errors import ErrorFinishMixin
from vllm_neuron_sched.core.limits import RequestLimits
from vllm_neuron_sched.core.prefill_shapes import (
    PrefillShape,
    engine_prefill_shapes,
    pick_shape,
)
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
    # PREFILL: the requests whose next chunk the step runs, in row order
    # (ongoing prefills first), and the shape that bounds each chunk.
    prefills: tuple["Request", ...] = ()
    shape: PrefillShape | None = None


class ChunkedPrefillMixin(ErrorFinishMixin):
    """Policy over vLLM's ``Scheduler`` or ``AsyncScheduler`` (listed after it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.interleave_prefills = envs.VLLM_NEURON_SCHED_PREFILL_INTERLEAVING
        self.limits = RequestLimits.from_config(self.vllm_config)
        self.prefill_shapes = engine_prefill_shapes(self.vllm_config)
        self.max_prefill_requests = max(s.max_requests for s in self.prefill_shapes)
        # Kind of the last *scheduled* step (the device runs steps in that order).
        self.last_step_kind = StepPlanKind.IDLE
        # vLLM scheduled nothing of the last prefill plan: decode first.
        self.prefill_declined = False
        # The engine brings a grammar up to date with the oldest step in its
        # batch queue only: at depth 2 that is the step holding the request's
        # token, in a deeper queue (pipeline stages) it may not be, so there a
        # grammar-bound request waits for its tokens.
        self.grammar_waits_for_tokens = self.vllm_config.max_concurrent_batches > 2

    # --- the step ---------------------------------------------------------

    def schedule(self, *args, **kwargs) -> "SchedulerOutput":
        plan = self.plan_step()
        chunks = nullcontext()
        if plan.kind is StepPlanKind.PREFILL:
            running = [r for r in plan.prefills if r.status == RequestStatus.RUNNING]
            waiting = [r for r in plan.prefills if r.status != RequestStatus.RUNNING]
            view = restricted_view(self, running, waiting)
            chunks = self._chunks_of(plan)
        elif plan.kind is StepPlanKind.DECODE:
            decoding = [
                r for r in self.decoding_requests() if self.can_schedule_decode(r)
            ]
            view = restricted_view(self, decoding, [])
        else:
            view = restricted_view(self, [], [])
        with view, chunks:
            output = super().schedule(*args, **kwargs)
        if output.num_scheduled_tokens:
            # An idle step (a batch queue's decodes all in flight) gives no
            # decode a turn: interleaving goes by the last step that ran.
            self.last_step_kind = plan.kind
        self.prefill_declined = (
            plan.kind is StepPlanKind.PREFILL and not output.num_scheduled_tokens
        )
        if self.prefill_declined:
            # Admission counts what vLLM needs, so this is a bug; running
            # the same plan again would stall the decodes for good.
            logger.warning(
                "vLLM's scheduler declined the planned prefill step of %s "
                "(shape %s); the next step decodes",
                [r.request_id for r in plan.prefills],
                plan.shape,
            )
        return output

    def plan_step(self) -> StepPlan:
        """Prefill when allowed (TTFT), else decode, else nothing."""
        can_decode = any(self.can_schedule_decode(r) for r in self.decoding_requests())
        candidates = self.prefill_candidates()
        after_prefill = self.last_step_kind is StepPlanKind.PREFILL
        decodes_first = can_decode and (
            self.prefill_declined or (self.interleave_prefills and after_prefill)
        )
        if candidates and not decodes_first:
            tokens = [self.chunk_tokens(r) for r in candidates]
            shape, count = pick_shape(tokens, self.prefill_shapes)
            return StepPlan(StepPlanKind.PREFILL, tuple(candidates[:count]), shape)
        if can_decode:
            return StepPlan(StepPlanKind.DECODE)
        return StepPlan(StepPlanKind.IDLE)

    @contextmanager
    def _chunks_of(self, plan: StepPlan) -> Iterator[None]:
        """vLLM's ``schedule()`` gives each request of the step at most the
        shape's tokens per row (its long-prefill cap, fixed, not adaptive)
        and the step at most a row per request, or for a packed row the
        row's tokens in all: each request in turn takes what is left of it."""
        shape = plan.shape
        assert shape is not None
        config = self.scheduler_config
        saved = (
            config.long_prefill_token_threshold,
            self.adaptive_long_prefill_threshold,
            self.max_num_scheduled_tokens,
        )
        config.long_prefill_token_threshold = shape.tokens
        self.adaptive_long_prefill_threshold = False
        rows = 1 if shape.packed else len(plan.prefills)
        self.max_num_scheduled_tokens = min(saved[2], rows * shape.tokens)
        try:
            yield
        finally:
            (
                config.long_prefill_token_threshold,
                self.adaptive_long_prefill_threshold,
                self.max_num_scheduled_tokens,
            ) = saved

    # --- schedule-time views of the running set ------------------------------

    def ongoing_prefills(self) -> list["Request"]:
        return [r for r in self.running if r.is_prefill_chunk]

    def prompt_tokens_left(self, request: "Request") -> int:
        """Prompt tokens the request still has to run, after the prefix its
        first step will take from the prefix cache (vLLM's own lookup)."""
        computed = request.num_computed_tokens
        if request.status != RequestStatus.RUNNING and not computed:
            computed = self.kv_cache_manager.get_computed_blocks(request)[1]
        return request.num_tokens - computed

    def chunk_tokens(self, request: "Request") -> int:
        """Tokens vLLM may schedule for the request's rest: its prompt tokens
        left, or ``1 + K`` for a one-token rest when the engine speculates
        (vLLM pads it with K placeholder drafts, and never splits that)."""
        left = self.prompt_tokens_left(request)
        return 1 + self.num_spec_tokens if left == 1 else left

    def decoding_requests(self) -> list["Request"]:
        return [r for r in self.running if not r.is_prefill_chunk]

    def decode_tkv(self, requests: list["Request"] | None = None) -> int:
        """The decode batch's tkv: its largest position (the batch is
        rectangular, shorter rows left-padded), as of the last scheduled step."""
        batch = self.decoding_requests() if requests is None else requests
        return max((r.num_computed_tokens for r in batch), default=0)

    def can_schedule_decode(self, request: "Request") -> bool:
        """The request has a token to run, and the steps in flight do not
        reach ``max_tokens`` yet. Known up front, so no empty decode step is
        planned, and only such requests are in the decode step's view.

        Its next input is still in flight when a sync scheduler runs in a
        batch queue (pipeline stages). Without drafts each step in flight
        holds one of its tokens (a placeholder), at any queue depth; vLLM's
        own test assumes at most two steps in flight and would schedule past
        ``max_tokens`` in a deeper queue. With drafts (two steps in flight:
        speculation refuses pipeline stages) vLLM's test: a verify step
        yields at least one token whatever it rejects. A request bound to a
        grammar waits for its tokens in a queue deeper than two
        (``grammar_waits_for_tokens``)."""
        if (
            request.num_tokens_with_spec + request.num_output_placeholders
            <= request.num_computed_tokens
        ):
            return False
        if (
            self.grammar_waits_for_tokens
            and request.use_structured_output
            and request.num_output_placeholders > 0
        ):
            return False
        if not self.num_spec_tokens:
            return self.remaining_tokens(request) > 0
        return not (
            request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens
        )

    def remaining_tokens(self, request: "Request") -> int:
        """Output tokens the request may still be scheduled for."""
        produced = request.num_output_tokens + request.num_output_placeholders
        return max(0, request.max_tokens - produced)

    def blocks_needed(self, request: "Request") -> list[int]:
        """KV blocks per cache group for the request's whole life: prompt +
        max_tokens, and the drafts' lookahead. A group whose blocks leave
        the attention window (sliding window) needs at most vLLM's own
        admission cap at a time."""
        num_tokens = min(
            request.num_prompt_tokens + request.max_tokens + self.limits.spec_lookahead,
            self.max_model_len,
        )
        needed = []
        for group in self.kv_cache_manager.coordinator.single_type_managers:
            blocks = cdiv(num_tokens, group.block_size)
            if (cap := group.max_admission_blocks_per_request) is not None:
                blocks = min(blocks, cap)
            needed.append(blocks)
        return needed

    def reserved_blocks(self) -> int:
        """Blocks promised to running requests but not allocated yet, in
        every cache group (a window's freed blocks are the null block)."""
        null = self.kv_cache_manager.block_pool.null_block.block_id
        reserved = 0
        for request in self.running:
            held = self.kv_cache_manager.get_block_ids(request.request_id)
            for needed, blocks in zip(self.blocks_needed(request), held):
                reserved += max(0, needed - sum(b != null for b in blocks))
        return reserved

    # --- admission -----------------------------------------------------------

    def prefill_candidates(self) -> list["Request"]:
        """Who the next prefill step may hold, in row order: the ongoing
        prefills, then ready waiting requests in arrival order, each admitted
        only together with those before it (the first that does not fit stops
        the queue, as vLLM's FCFS does).

        Served in order, those holding KV blocks first (as vLLM does); a
        request still compiling its grammar is passed over (vLLM's scheduler
        does the same) until the grammar is ready.
        """
        candidates = self.ongoing_prefills()
        joining: list[Request] = []
        queued = itertools.chain(self.kv_holding_waiting, self.waiting)
        for request in queued:
            if len(candidates) >= self.max_prefill_requests:
                break
            if not self._handle_blocked_waiting_request(request):
                continue
            if not self.adapter_fits(request, joining):
                continue  # passed over, as vLLM's scheduler does
            if not self.can_admit(request, joining):
                break
            joining.append(request)
            candidates.append(request)
        return candidates

    def adapter_fits(self, candidate: "Request", joining: list["Request"]) -> bool:
        """With LoRA, a request may start only if the adapters of every
        running request (whether this step holds them or not: they decode in
        one step later), those joining and its own fit ``max_loras`` slots.
        vLLM's check sees only the requests a step holds."""
        lora_config = self.lora_config
        adapter = candidate.lora_request
        if lora_config is None or adapter is None or adapter.lora_int_id <= 0:
            return True
        in_use = {
            r.lora_request.lora_int_id
            for r in itertools.chain(self.running, joining)
            if r.lora_request is not None and r.lora_request.lora_int_id > 0
        }
        return adapter.lora_int_id in in_use or len(in_use) < lora_config.max_loras

    def can_admit(self, candidate: "Request", joining: list["Request"]) -> bool:
        """Whether ``candidate`` may start along with ``joining`` (waiting
        requests admitted to the same step before it): a running slot, KV
        blocks for its whole life after everything promised, and the tkv
        limit for the batch all of them will decode in."""
        if len(self.running) + len(joining) >= self.max_num_running_reqs:
            return False
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        promised = self.reserved_blocks()
        promised += sum(sum(self.blocks_needed(r)) for r in joining)
        if free - promised < sum(self.blocks_needed(candidate)):
            return False
        decoding = self.decoding_requests()
        batch = [*self.running, *joining, candidate]
        # Prefilling requests join the decode batch at their prompt's length.
        prompts = [r.num_tokens for r in batch if r not in decoding]
        tkv_after_join = max(max(prompts), self.decode_tkv(decoding))
        worst_tkv = tkv_after_join + max(self.remaining_tokens(r) for r in batch)
        worst_tkv += self.limits.spec_lookahead
        return len(batch) * worst_tkv <= self.limits.max_batch_tkv_limit
