"""The verify step (``VerifyStep``, a step kind: ``worker/steps.py``): its
plan on the host (``plan_verify``), its inputs completed on the device from
the token table (``complete_on_device``), the forward, and its verification
after the forward (``verify_on_device``)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.runtime import DeviceFuture, Materializer
from vllm_neuron_sched.worker.device_forward import run_model
from vllm_neuron_sched.worker.layout import (
    BlockTables,
    Sequences,
    block_tables,
    rectangle,
)
from vllm_neuron_sched.worker.logits_rules import NO_RULES, RowRules
from vllm_neuron_sched.worker.lora import StepAdapters, verify_adapters
from vllm_neuron_sched.worker.results import (
    Drafts,
    Verified,
    VerifyForward,
    make_output_materializer,
)
from vllm_neuron_sched.worker.sampling import noise_dtype, sampling_inputs
from vllm_neuron_sched.worker.spec.constraints import constrain_verify_logits
from vllm_neuron_sched.worker.spec.grammar import (
    VerifyGrammar,
    apply_verify_grammar,
    plan_grammar,
)
from vllm_neuron_sched.worker.spec.proposer import AcceptedTokens, Proposer
from vllm_neuron_sched.worker.spec.rejection import (
    REJECTED,
    Randomness,
    draw_randomness,
    rejection_sample,
    verify_logprobs,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.host_state import (
        HostRequestState,
        PromptLogprobsJob,
        StepUpdate,
    )
    from vllm_neuron_sched.worker.programs import Programs
    from vllm_neuron_sched.worker.sampling_state import SamplingState
    from vllm_neuron_sched.worker.steps import StepContext, StepRows
    from vllm_neuron_sched.worker.token_table import DeviceTokens


@dataclass(frozen=True)
class VerifyPlan:
    """What the host knows of a verify step: the rows, their slots, how many
    drafts the scheduler gave each, and the block tables. The device derives
    the rest (``complete_on_device``)."""

    width: int  # queries per row: 1 + K, or 1 when no row has drafts
    num_rows: int
    num_rows_padded: int  # the decode bucket
    slots: torch.Tensor  # [num_rows] int64 token slots
    scheduled_drafts: torch.Tensor  # [num_rows] int64
    prompt_lens: torch.Tensor  # [num_rows] int64 (penalties count what follows)
    groups: "list[AttentionGroup]"
    tables: BlockTables  # the rows' (the device pads them to the step)
    rules: RowRules = NO_RULES  # the rows' logits rules (``plan_rules``)

    @property
    def num_tokens_padded(self) -> int:
        return self.num_rows_padded * self.width


def plan_verify(
    batch: "InputBatch",
    scheduled_drafts: np.ndarray,
    token_slots: np.ndarray,
    num_rows_padded: int,
    num_spec_tokens: int,
    attn_groups: "list[AttentionGroup]",
    rules: RowRules = NO_RULES,
) -> VerifyPlan:
    """Host side, from the scheduler's decisions only: no position, since the
    scheduler's ``num_computed_tokens`` may count drafts the device rejected
    (it plans optimistically)."""
    num_rows = batch.num_reqs
    return VerifyPlan(
        width=1 + num_spec_tokens if scheduled_drafts.any() else 1,
        num_rows=num_rows,
        num_rows_padded=num_rows_padded,
        slots=torch.from_numpy(token_slots[:num_rows].copy()),
        scheduled_drafts=torch.from_numpy(scheduled_drafts.astype(np.int64)),
        prompt_lens=torch.from_numpy(
            batch.num_prompt_tokens[:num_rows].astype(np.int64)
        ),
        groups=attn_groups,
        tables=block_tables(batch, num_rows),
        rules=rules,
    )


@dataclass
class VerifyInputs:
    """A verify step's inputs, completed on the device."""

    input_ids: torch.Tensor  # [num_tokens_padded] int32
    sequences: Sequences
    num_drafts: torch.Tensor  # [num_rows] drafts each row verifies
    starts: torch.Tensor  # [num_rows] where each row's new tokens go
    drafts: torch.Tensor  # [num_rows, K] int32: the drafts it verifies


def complete_on_device(
    plan: VerifyPlan, tokens: "DeviceTokens", programs: "Programs"
) -> VerifyInputs:
    """Device side: row i's queries are a rectangle's row (``layout.py``):
    the newest token at position ``length - 1``, then the drafts. Queries
    past a row's drafts, and padded rows, write no KV and are never sampled.
    Every position is below the token table's width, the sequences' bound."""
    rows, width = plan.num_rows, plan.width
    read = tokens.drafts_of(plan.slots)
    num_drafts = torch.minimum(read.counts, plan.scheduled_drafts)
    if width == 1:
        num_drafts = torch.zeros_like(num_drafts)
    ids = torch.zeros((plan.num_rows_padded, width), dtype=torch.int32)
    ids[:rows, 0] = read.newest
    ids[:rows, 1:] = read.drafts[:, : width - 1]
    sequences = rectangle(
        plan.num_rows_padded,
        width,
        read.lengths - 1,
        1 + num_drafts,
        plan.tables,
        tokens.history_len,
        programs.rectangle_queries,
    )
    return VerifyInputs(
        input_ids=ids.flatten(),
        sequences=sequences,
        num_drafts=num_drafts,
        starts=read.lengths,
        drafts=read.drafts,
    )


def verify_on_device(
    proposer: Proposer,
    sampler: "Sampler",
    tokens: "DeviceTokens",
    state: "SamplingState",
    forward: VerifyForward,
    metadata: "SamplingMetadata",
    needs_histories: bool,
    req_ids: list[str],
    plan: VerifyPlan,
    programs: "Programs",
    random: Randomness | None,
    grammar: VerifyGrammar | None = None,
) -> Verified:
    """Device side, after the verify forward: the logits in float32 (as
    vLLM's rejection sampler takes them, whatever the model's dtype), the
    grammar's masks (in place, so the raw logprobs see them, as in vLLM),
    rejection sampling after the host's draws (``random``), the accepted
    tokens into the histories and the table, the next drafts."""
    with torch.inference_mode():
        metadata = state.sampling_metadata(metadata, req_ids, needs_histories)
        raw_logits = forward.logits.to(torch.float32)
        num_drafts = forward.num_drafts
        if grammar is not None:
            num_drafts = apply_verify_grammar(raw_logits, num_drafts, grammar)
        logits, metadata = constrain_verify_logits(
            raw_logits, plan, tokens, forward.drafts, metadata, programs
        )
        sampled = rejection_sample(
            logits,
            plan.width,
            num_drafts,
            forward.drafts,
            random,
            programs,
        )
        accepted = (sampled != REJECTED).sum(dim=1)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = verify_logprobs(sampler, raw_logits, logits, sampled, metadata)
        tokens.accept(plan.slots, forward.starts, sampled, accepted)
        state.record(req_ids, sampled, accepted)
        proposer.propose(
            tokens,
            AcceptedTokens(
                plan.slots,
                forward.starts,
                sampled,
                accepted,
                plan.tables,
            ),
        )
        read = tokens.drafts_of(plan.slots)
        drafts = Drafts(read.drafts, read.counts)
        return Verified(sampled, accepted, logprobs, drafts)


class VerifyStep:
    """A decode step under speculative decoding: each row runs its newest
    token and its drafts, ``[decode bucket, 1 + K]``; the host's part is the
    plan, the device completes the inputs from the token table, runs the
    model, then verifies (rejection sampling) and proposes the next drafts."""

    drafts = True
    shape = BatchShape.DECODE
    needs_host_tokens = False

    def __init__(
        self,
        req_ids: list[str],
        plan: VerifyPlan,
        num_new_tokens: np.ndarray,
        adapters: StepAdapters | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.plan = plan
        self.adapters = adapters
        self.num_new_tokens = num_new_tokens
        self.num_table_rows = plan.num_rows
        self._forward: DeviceFuture | None = None

    @classmethod
    def build(
        cls,
        ctx: "StepContext",
        host: "HostRequestState",
        rows: "StepRows",
        update: "StepUpdate",
    ) -> "VerifyStep":
        assert ctx.speculation is not None
        plan = plan_verify(
            update.batch,
            rows.num_drafts,
            update.token_slots,
            ctx.buckets.pad_decode(len(rows.req_ids)),
            ctx.speculation.num_tokens,
            ctx.kv_cache.attn_groups,
            ctx.rules_of(host, rows.req_ids),
        )
        adapters = None
        if ctx.lora is not None:
            adapters = verify_adapters(update.batch, plan.num_rows_padded, plan.width)
        # Every row adds its newest token and its drafts, as the scheduler
        # counts them (placeholders until the step retires).
        return cls(rows.req_ids, plan, rows.num_scheduled.astype(np.int64), adapters)

    def enqueue_forward(
        self, ctx: "StepContext", prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None:
        assert not prompt_logprobs_jobs, "a verify step runs no prompt chunk"
        self._forward = ctx.device.enqueue(
            _verify_forward_on_device, ctx, self.plan, self.adapters
        )

    def enqueue_sampling(
        self,
        ctx: "StepContext",
        update: "StepUpdate",
        grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
    ) -> "tuple[DeviceFuture, Materializer[ModelRunnerOutput]]":
        assert self._forward is not None and ctx.proposer is not None
        assert ctx.speculation is not None
        # Its grammar masks are planned below, per query.
        metadata, needs_histories, _, _ = sampling_inputs(
            update.batch.sampling_metadata,
            None,
            self.req_ids,
            snapshot=not ctx.device.runs_at_enqueue,
        )
        verify_grammar = None
        if grammar is not None:
            scheduler_output, grammar_output = grammar
            verify_grammar = plan_grammar(
                grammar_output,
                list(self.req_ids),
                scheduler_output.scheduled_spec_decode_tokens,
                self.plan.width,
            )
        result = ctx.device.enqueue(
            verify_on_device,
            ctx.proposer,
            ctx.sampler,
            ctx.token_table,
            ctx.sampling,
            self._forward,
            metadata,
            needs_histories,
            self.req_ids,
            self.plan,
            ctx.programs,
            # The rows' draws, on the host (their generators are host
            # objects), for every draft slot: the device knows how many
            # drafts each row verifies.
            draw_randomness(
                metadata,
                ctx.speculation.num_tokens,
                ctx.vocab_size,
                noise_dtype(ctx.sampler),
            ),
            verify_grammar,
        )
        output = make_output_materializer(
            result,
            self.req_ids,
            [True] * len(self.req_ids),
            update.prompt_logprobs,
            ctx.fails_requests_alone,
        )
        return result, output


def _verify_forward_on_device(
    ctx: "StepContext", plan: VerifyPlan, adapters: StepAdapters | None
) -> VerifyForward:
    """Runs on the device: a verify step's inputs from the token slots, its
    adapters, then the model at ``[decode bucket, 1 + K]``, logits of every
    real row's queries."""
    with torch.inference_mode():
        inputs = complete_on_device(plan, ctx.token_table, ctx.programs)
        if adapters is not None:
            assert ctx.lora is not None
            ctx.lora.activate(adapters)
        hidden_states = run_model(
            ctx.model,
            ctx.vllm_config,
            inputs.input_ids,
            inputs.sequences.model_positions(ctx.max_model_len),
            *inputs.sequences.attention(plan.groups),
            plan.num_tokens_padded,
        )
        num_real = plan.num_rows * plan.width
        return VerifyForward(
            ctx.programs.compute_logits(hidden_states[:num_real], ctx.model),
            inputs.num_drafts,
            inputs.starts,
            inputs.drafts,
        )
