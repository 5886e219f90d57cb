"""A step as an object: what the runner enqueues for one scheduler step.

A step kind owns its host-side build (``build``, from the scheduler's rows and
the host state), its device program (``enqueue_forward``: the forward
execution; ``enqueue_sampling``: its last execution, and the output the host
reads from it) and its typed device result (``results.py``). The runner picks
the kind once, from the batch's shape (``StepKinds``), and from then on the
async flow, the counters and the error path see this one interface.

``PrefillStep``, ``DecodeStep`` and ``MixedStep`` (a scheduler that mixes)
run inputs the host laid out (``inputs.py``); with speculative decoding the
kinds are ``spec/steps.py``'s. A kind is a shape and the programs it runs;
what a pipeline stage changes (where the forward starts and ends, where the
tokens come from) is the stage's (``StepContext.stage``, ``pipeline.py``),
the same for every kind.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from vllm.v1.outputs import ModelRunnerOutput

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.runtime import DeviceFuture, Materializer
from vllm_neuron_sched.worker.device_forward import run_model
from vllm_neuron_sched.worker.inputs import StepInputs, token_inputs
from vllm_neuron_sched.worker.logits_rules import NO_RULES, RowRules, plan_rules
from vllm_neuron_sched.worker.lora import StepAdapters, step_adapters
from vllm_neuron_sched.worker.pipeline import ONE_STAGE, Stage
from vllm_neuron_sched.worker.programs import EAGER, Programs
from vllm_neuron_sched.worker.results import Sampled, make_output_materializer
from vllm_neuron_sched.worker.sampling import (
    Draws,
    StepMasks,
    prompt_logprobs_on_device,
    sample_on_device,
    sampling_inputs,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.core.prefill_shapes import PrefillShape
    from vllm_neuron_sched.runtime import Device
    from vllm_neuron_sched.worker.buckets import Buckets
    from vllm_neuron_sched.worker.host_state import (
        HostRequestState,
        PromptLogprobsJob,
        StepUpdate,
    )
    from vllm_neuron_sched.worker.kv_cache import KVCache
    from vllm_neuron_sched.worker.lora import Adapters
    from vllm_neuron_sched.worker.sampling_state import SamplingState
    from vllm_neuron_sched.worker.spec.config import Speculation
    from vllm_neuron_sched.worker.spec.proposer import Proposer
    from vllm_neuron_sched.worker.token_table import DeviceTokens

    # The engine's grammar masks for a step's sampling, when it has any.
    Grammar = tuple[SchedulerOutput, GrammarOutput] | None


@dataclass(frozen=True)
class StepRows:
    """The step's rows as the scheduler decided them, and what each does."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # [num_reqs] tokens scheduled
    # [num_reqs] tokens the row runs: all scheduled but the placeholder
    # drafts vLLM pads a one-token prompt rest with under speculation.
    num_run: np.ndarray
    num_computed: np.ndarray  # [num_reqs] tokens computed before the step
    # [num_reqs] tokens known as the scheduler counts them (prompt, outputs,
    # in-flight placeholders): a row decodes when it runs the newest.
    num_known: np.ndarray
    num_drafts: np.ndarray  # [num_reqs] drafts scheduled (0 unless speculating)
    # [num_reqs] True: the row runs its newest token (and drafts), its input
    # id from the token table; False: prompt tokens the host holds.
    is_decode_row: np.ndarray
    shape: BatchShape

    @classmethod
    def of(
        cls, scheduler_output: "SchedulerOutput", update: "StepUpdate"
    ) -> "StepRows":
        batch = update.batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = np.array([scheduled[r] for r in req_ids], np.int64)
        num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], np.int64)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        num_known = update.scheduled_num_tokens
        is_decode_row = (
            (num_scheduled == 1 + num_drafts)
            & (num_computed + 1 == num_known)
            & (num_computed >= update.prompt_lens)
        )
        is_prefill_row = ~is_decode_row
        shape = BatchShape.of(is_prefill_row.tolist())
        num_run = num_scheduled
        if drafts:
            num_run = np.where(is_prefill_row, num_scheduled - num_drafts, num_run)
        return cls(
            req_ids,
            num_scheduled,
            num_run,
            num_computed,
            num_known,
            num_drafts,
            is_decode_row,
            shape,
        )


@dataclass
class StepContext:
    """What every step's build and device program run with, fixed at
    start-up (the model once loaded)."""

    device: "Device"
    vllm_config: "VllmConfig"
    sampler: "Sampler"
    token_table: "DeviceTokens"
    # The logits processors and output histories (``sampling_state.py``).
    sampling: "SamplingState"
    buckets: "Buckets"
    kv_cache: "KVCache"
    # Our schedulers finish a failed step's requests and serve the others.
    fails_requests_alone: bool
    # Speculative decoding: its settings and what proposes the drafts.
    speculation: "Speculation | None" = None
    proposer: "Proposer | None" = None
    # Pipeline parallel: this rank's stage (``ONE_STAGE`` without one).
    stage: Stage = ONE_STAGE
    # LoRA (--enable-lora): the adapter manager, on the device side.
    lora: "Adapters | None" = None
    model: Any = None
    # The programs around the forward: eager, or compiled per declared shape
    # on the compiled device (``worker/programs.py``).
    programs: Programs = EAGER

    @property
    def max_model_len(self) -> int:
        return self.vllm_config.model_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.vllm_config.model_config.get_vocab_size()

    @property
    def programs_sample(self) -> bool:
        """The programs sample on this rank: the last pipeline stage, in an
        engine without the user's logits processors (vLLM's sampler runs
        those, with its own rules and draws)."""
        return self.stage.is_last and not self.sampling.user_processors

    def rules_of(self, host: "HostRequestState", req_ids: list[str]) -> RowRules:
        """The rows' logits rules, planned at the programs' bad-words shape
        where the programs sample (none elsewhere: nothing reads them)."""
        if not self.programs_sample:
            return NO_RULES
        return plan_rules(
            [host.requests[req_id].sampling_params for req_id in req_ids],
            self.vocab_size,
            self.programs.bad_words_shape,
        )


class Step(Protocol):
    """One scheduler step on the device: two executions enqueued in order,
    the forward (``execute_model``) and the last one (``sample_tokens``)."""

    req_ids: list[str]
    shape: BatchShape
    # [num_reqs] tokens each row adds to its history (placeholders).
    num_new_tokens: np.ndarray
    # Its sampling also proposes drafts (the scheduler may ask for them).
    drafts: bool
    # An input token is still on the device where the host must hold it
    # (not expected with our schedulers): the runner retires what is in
    # flight and starts the step again.
    needs_host_tokens: bool
    # Rows whose input ids the forward reads from the token table.
    num_table_rows: int

    @classmethod
    def build(
        cls,
        ctx: StepContext,
        host: "HostRequestState",
        rows: StepRows,
        update: "StepUpdate",
    ) -> "Step": ...

    def enqueue_forward(
        self, ctx: StepContext, prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None: ...

    def enqueue_sampling(
        self, ctx: StepContext, update: "StepUpdate", grammar: "Grammar"
    ) -> tuple[DeviceFuture, Materializer[ModelRunnerOutput]]:
        """The step's last execution and its output: sampling, or for a step
        that samples nothing its forward (whose failure must reach the
        requests too). ``update``: the step's, whose input batch's sampling
        metadata is read now (a threaded device gets a snapshot)."""
        ...


@dataclass(frozen=True)
class StepKinds:
    """The step class for each batch shape; None: this runner cannot run it."""

    prefill: type[Step]
    decode: type[Step]
    mixed: type[Step] | None
    # Why a step that mixes cannot run, when ``mixed`` is None (the start-up
    # check refuses such a scheduler first; this is the backstop).
    no_mixed_reason: str = ""

    def start(
        self,
        ctx: StepContext,
        host: "HostRequestState",
        scheduler_output: "SchedulerOutput",
        update: "StepUpdate",
    ) -> Step:
        """The step of the scheduler's decisions: its kind, picked once from
        its rows, builds it and enqueues its forward, unless it needs host
        tokens (then nothing is enqueued)."""
        rows = StepRows.of(scheduler_output, update)
        step = self.of(rows.shape).build(ctx, host, rows, update)
        if not step.needs_host_tokens:
            step.enqueue_forward(ctx, update.prompt_logprobs_jobs)
        return step

    def of(self, shape: BatchShape) -> type[Step]:
        if shape is BatchShape.PREFILL:
            return self.prefill
        if shape is BatchShape.DECODE:
            return self.decode
        if self.mixed is None:
            raise RuntimeError(
                f"a step that mixes prefill and decode cannot run: "
                f"{self.no_mixed_reason}"
            )
        return self.mixed


class TokensStep:
    """A step whose input tokens the host laid out: its kind says at which
    shape (``padded_shape``); the device gathers decode rows' ids from the
    token table, runs the model and samples."""

    shape: ClassVar[BatchShape]
    drafts: ClassVar[bool] = False

    def __init__(
        self,
        inputs: StepInputs,
        num_new_tokens: np.ndarray,
        adapters: "StepAdapters | None" = None,
    ) -> None:
        self.inputs = inputs
        self.adapters = adapters
        self.req_ids = inputs.req_ids
        self.num_new_tokens = num_new_tokens
        self.needs_host_tokens = inputs.needs_host_tokens
        self.num_table_rows = inputs.num_table_rows
        self._logits: DeviceFuture | None = None

    @classmethod
    def padded_shape(cls, buckets: "Buckets", rows: StepRows) -> "PrefillShape | int":
        """This kind's static shape for ``rows`` (``Layout.of``)."""
        raise NotImplementedError

    @classmethod
    def inputs_of(
        cls,
        ctx: StepContext,
        host: "HostRequestState",
        rows: StepRows,
        update: "StepUpdate",
    ) -> StepInputs:
        return token_inputs(
            update.batch,
            rows,
            cls.padded_shape(ctx.buckets, rows),
            update.token_slots,
            ctx.kv_cache.attn_groups,
            ctx.max_model_len,
            ctx.token_table.history_len,
            update.num_cached_prompt_tokens,
            ctx.rules_of(host, rows.req_ids),
        )

    @classmethod
    def build(
        cls,
        ctx: StepContext,
        host: "HostRequestState",
        rows: StepRows,
        update: "StepUpdate",
    ) -> "TokensStep":
        inputs = cls.inputs_of(ctx, host, rows, update)
        return cls(
            inputs,
            inputs.is_sampled.astype(np.int64),
            cls.adapters_of(ctx, update, inputs),
        )

    @staticmethod
    def adapters_of(
        ctx: StepContext, update: "StepUpdate", inputs: StepInputs
    ) -> "StepAdapters | None":
        """With LoRA, the step's adapter mapping at its padded shape."""
        if ctx.lora is None:
            return None
        layout = inputs.layout
        return step_adapters(update.batch, layout.tokens, layout.num_tokens_padded)

    def enqueue_forward(
        self, ctx: StepContext, prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None:
        self._logits = ctx.device.enqueue(
            self.forward_on_device, ctx, prompt_logprobs_jobs
        )

    def enqueue_sampling(
        self, ctx: StepContext, update: "StepUpdate", grammar: "Grammar"
    ) -> tuple[DeviceFuture, Materializer[ModelRunnerOutput]]:
        inputs = self.inputs
        assert self._logits is not None, "enqueue_forward first"
        result = self._logits
        if inputs.has_samples:
            result = ctx.device.enqueue(
                self.sample_on_device,
                ctx,
                self._logits,
                *sampling_inputs(
                    update.batch.sampling_metadata,
                    grammar,
                    inputs.req_ids,
                    snapshot=not ctx.device.runs_at_enqueue,
                    # Where the programs sample, the host draws, at enqueue.
                    drawn_for=(inputs, ctx.sampler, ctx.vocab_size)
                    if ctx.programs_sample
                    else None,
                ),
            )
        output = make_output_materializer(
            result,
            inputs.req_ids,
            inputs.is_sampled,
            update.prompt_logprobs,
            ctx.fails_requests_alone,
        )
        return result, output

    # ---- device side: inside the step's executions only ----------------------

    def forward_on_device(
        self, ctx: StepContext, prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> torch.Tensor | None:
        """Prompt tokens into the device histories, decode rows' ids from the
        token table, then the model at the padded shape; the sampling rows'
        logits (None when no row samples, or on a pipeline stage before the
        last, which sends its tensors on instead: the prompt logprobs are
        the last stage's, which has the logits)."""
        inputs = self.inputs
        with torch.inference_mode():
            # In place: a draft model's forward reads them after this one.
            inputs.input_ids[:] = ctx.token_table.forward_ids(
                inputs.input_ids,
                inputs.layout.positions,
                inputs.forward_ids,
                inputs.prefix_writes,
            )
            if self.adapters is not None:
                assert ctx.lora is not None
                ctx.lora.activate(self.adapters)
            hidden_states = self.run_model_on_device(ctx)
            if not ctx.stage.is_last:
                ctx.stage.send_hidden(hidden_states, ctx.programs)
                return None
            logprobs_mode = ctx.vllm_config.model_config.logprobs_mode
            for row, *job in prompt_logprobs_jobs:
                prompt_logprobs_on_device(
                    ctx.model,
                    ctx.sampler,
                    logprobs_mode,
                    hidden_states,
                    int(inputs.layout.row_offsets[row]),
                    *job,
                )
            if not inputs.has_samples:
                return None
            return ctx.programs.compute_logits(
                hidden_states[inputs.logits_indices], ctx.model
            )

    def run_model_on_device(self, ctx: StepContext) -> Any:
        """Hidden states, or a pipeline stage's intermediate tensors; a
        stage after the first starts from the previous stage's."""
        layout = self.inputs.layout
        return run_model(
            ctx.model,
            ctx.vllm_config,
            self.inputs.input_ids,
            layout.positions,
            layout.attn_inputs,
            layout.slot_mapping,
            layout.num_tokens_padded,
            ctx.stage.receive_hidden(ctx.model, layout.num_tokens_padded, ctx.programs),
        )

    def sample_on_device(
        self,
        ctx: StepContext,
        logits: torch.Tensor,
        metadata: "SamplingMetadata",
        needs_histories: bool,
        grammar: "StepMasks | None",
        draws: Draws | None,
    ) -> Sampled:
        """The rows' tokens, into the token table; the last pipeline stage
        sends them to every other stage, which takes them instead."""
        inputs = self.inputs
        if not ctx.stage.is_last:
            tokens = ctx.stage.share_tokens(
                torch.empty(inputs.sample_slots.shape, dtype=torch.int32),
                ctx.programs,
            )
            ctx.token_table.accept_sampled(
                inputs.sample_slots, inputs.next_positions, tokens
            )
            return Sampled(tokens, None)
        sampled = sample_on_device(
            ctx.sampler,
            ctx.programs,
            ctx.token_table,
            ctx.sampling,
            logits,
            metadata,
            needs_histories,
            inputs,
            grammar,
            draws,
        )
        ctx.stage.share_tokens(sampled.tokens, ctx.programs)
        return sampled


class PrefillStep(TokensStep):
    """Prompt chunks only, at a static prefill shape."""

    shape = BatchShape.PREFILL

    @classmethod
    def padded_shape(cls, buckets: "Buckets", rows: StepRows) -> "PrefillShape | int":
        return buckets.pad_prefill(rows.num_run.tolist())


class DecodeStep(TokensStep):
    """One newest token per row, its id from the token table, packed to the
    decode bucket."""

    shape = BatchShape.DECODE

    @classmethod
    def padded_shape(cls, buckets: "Buckets", rows: StepRows) -> int:
        return buckets.pad_decode(len(rows.req_ids))


class MixedStep(TokensStep):
    """Prompt chunks and decode rows together (a scheduler that mixes them,
    such as vLLM's own), packed to a token-count bucket."""

    shape = BatchShape.MIXED

    @classmethod
    def padded_shape(cls, buckets: "Buckets", rows: StepRows) -> int:
        return buckets.pad_tokens(int(rows.num_run.sum()))


PLAIN_STEPS = StepKinds(PrefillStep, DecodeStep, MixedStep)
