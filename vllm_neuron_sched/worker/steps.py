"""A step as an object: what the runner enqueues for one scheduler step.

A step kind owns its device program: ``enqueue_forward`` (the forward
execution) and ``enqueue_sampling`` (its last execution, and the output the
host reads from it). The runner picks the kind once, when the step's inputs
are built, and from then on the async flow, the counters and the error path
see this one interface. ``TokensStep`` runs inputs the host laid out (prompt
chunks, decode rows, or both under a scheduler that mixes); a verify step
(``spec/verify.py``, with speculative decoding) completes its inputs on the
device. A new kind (a pipeline stage, a device that runs other steps) is a
new class, not a flag.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.runtime import DeviceFuture, Materializer
from vllm_neuron_sched.worker.device_forward import run_model
from vllm_neuron_sched.worker.inputs import StepInputs
from vllm_neuron_sched.worker.results import make_output_materializer
from vllm_neuron_sched.worker.sampling import (
    history_repairs,
    own_masks,
    prompt_logprobs_on_device,
    sample_on_device,
    snapshot_sampling_metadata,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.runtime import Device
    from vllm_neuron_sched.worker.host_state import PromptLogprobsJob
    from vllm_neuron_sched.worker.spec.draft_model import DraftModel
    from vllm_neuron_sched.worker.spec.proposer import Proposer
    from vllm_neuron_sched.worker.token_table import DeviceTokens


@dataclass
class StepContext:
    """What every step's device program runs with, fixed at start-up."""

    device: "Device"
    vllm_config: "VllmConfig"
    sampler: "Sampler"
    token_table: "DeviceTokens"
    # Our schedulers finish a failed step's requests and serve the others.
    fails_requests_alone: bool
    # Speculative decoding: the proposer (a draft model, or None for n-gram).
    proposer: "Proposer | None" = None
    draft: "DraftModel | None" = None
    model: Any = None  # the runner's, once loaded

    @property
    def max_model_len(self) -> int:
        return self.vllm_config.model_config.max_model_len


class Step(Protocol):
    """One scheduler step on the device: two executions enqueued in order,
    the forward (``execute_model``) and the last one (``sample_tokens``)."""

    req_ids: list[str]
    shape: BatchShape
    # [num_reqs] tokens each row adds to its history (placeholders).
    num_new_tokens: np.ndarray
    # Its sampling also proposes drafts (the scheduler may ask for them).
    drafts: bool

    @property
    def num_table_rows(self) -> int:
        """Rows whose input ids the forward reads from the token table."""
        ...

    def enqueue_forward(
        self, ctx: StepContext, prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None: ...

    def enqueue_sampling(
        self,
        ctx: StepContext,
        metadata: "SamplingMetadata",
        grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
        prompt_logprobs: dict[str, LogprobsTensors],
    ) -> tuple[DeviceFuture, Materializer[ModelRunnerOutput]]:
        """The step's last execution and its output: sampling, or for a step
        that samples nothing its forward (whose failure must reach the
        requests too). ``metadata``: the input batch's, read now (a
        threaded device gets a snapshot)."""
        ...


class TokensStep:
    """A step whose input tokens the host laid out (``inputs.py``): prompt
    chunks, decode rows reading their ids from the token table, or both."""

    def __init__(self, inputs: StepInputs, proposes: bool) -> None:
        self.inputs = inputs
        self.req_ids = inputs.req_ids
        self.shape = inputs.shape
        self.num_new_tokens = inputs.num_new_tokens
        self.drafts = proposes
        self._logits: DeviceFuture | None = None

    @property
    def num_table_rows(self) -> int:
        return self.inputs.num_table_rows

    def enqueue_forward(
        self, ctx: StepContext, prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None:
        inputs = self.inputs
        self._logits = ctx.device.enqueue(
            _forward_on_device,
            ctx,
            inputs,
            prompt_logprobs_jobs,
        )

    def enqueue_sampling(
        self,
        ctx: StepContext,
        metadata: "SamplingMetadata",
        grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
        prompt_logprobs: dict[str, LogprobsTensors],
    ) -> tuple[DeviceFuture, Materializer[ModelRunnerOutput]]:
        inputs = self.inputs
        assert self._logits is not None, "enqueue_forward first"
        result = self._logits
        if inputs.has_samples:
            repairs = history_repairs(metadata.output_token_ids, inputs.token_slots)
            if not ctx.device.runs_at_enqueue:
                metadata = snapshot_sampling_metadata(metadata)
            result = ctx.device.enqueue(
                sample_on_device,
                ctx.sampler,
                ctx.token_table,
                self._logits,
                metadata,
                inputs.sample_slots,
                np.flatnonzero(~inputs.is_sampled).tolist(),
                repairs,
                None if grammar is None else own_masks(*grammar, inputs.req_ids),
                None
                if ctx.proposer is None
                else (ctx.proposer, inputs.next_positions, inputs.block_tables()),
            )
        output = make_output_materializer(
            result,
            inputs.req_ids,
            inputs.is_sampled,
            prompt_logprobs,
            ctx.fails_requests_alone,
        )
        return result, output


def _forward_on_device(
    ctx: StepContext,
    inputs: StepInputs,
    prompt_logprobs_jobs: "list[PromptLogprobsJob]",
) -> torch.Tensor | None:
    """Runs on the device: decode rows' ids from the token table, then the
    model at its padded shape; the sampling rows' logits (None when no row
    samples)."""
    with torch.inference_mode():
        ctx.token_table.gather(inputs.input_ids, inputs.gather)
        if inputs.history_writes is not None:
            ctx.token_table.record(*inputs.history_writes)
        hidden_states = run_model(
            ctx.model,
            ctx.vllm_config,
            inputs.input_ids,
            inputs.positions,
            inputs.attn_inputs,
            inputs.slot_mapping,
            inputs.num_tokens_padded,
        )
        if ctx.draft is not None:
            ctx.draft.prefill(
                inputs.input_ids,
                inputs.positions,
                inputs.attn_inputs,
                inputs.num_tokens_padded,
            )
        logprobs_mode = ctx.vllm_config.model_config.logprobs_mode
        for row, *job in prompt_logprobs_jobs:
            prompt_logprobs_on_device(
                ctx.model,
                ctx.sampler,
                logprobs_mode,
                hidden_states,
                int(inputs.row_offsets[row]),
                *job,
            )
        if not inputs.has_samples:
            return None
        return ctx.model.compute_logits(hidden_states[inputs.logits_indices])
