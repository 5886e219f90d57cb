"""Pipeline parallel: a stage's part of each step, as step kinds.

Every stage runs every step at the same static shape, in the same order, so
the transfers between stages need no metadata: a stage that is not the first
receives the previous stage's intermediate tensors (``hidden_states``,
``residual``) at the step's padded token count, and one that is not the last
sends its own. Only the last stage has logits: it samples, and sends the
sampled tokens to every other stage (a broadcast over vLLM's pipeline group),
which write them into their own token table. So every stage's token table,
and every stage's host state, holds the same tokens: the first stage's decode
rows take their input ids from its table one step later, with no host read.

All of it happens inside device executions (the forward, the sampling), in
enqueue order on each rank's device, which is what matches the transfers up
across ranks; the host thread never touches the pipeline group.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.sequence import IntermediateTensors

from vllm_neuron_sched.worker.results import Sampled
from vllm_neuron_sched.worker.steps import StepKinds, TokensStep

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.host_state import PromptLogprobsJob
    from vllm_neuron_sched.worker.sampling import StepMasks
    from vllm_neuron_sched.worker.steps import StepContext


@dataclass(frozen=True)
class PipelineStage:
    """This rank's place in the pipeline (vLLM's pipeline group)."""

    group: "GroupCoordinator"

    @property
    def is_first(self) -> bool:
        return self.group.is_first_rank

    @property
    def is_last(self) -> bool:
        return self.group.is_last_rank

    def receive_hidden(self, model: Any, num_tokens: int) -> IntermediateTensors:
        """Device side: the previous stage's tensors, received into buffers
        of the step's shape (one allocation, no metadata)."""
        received = empty_hidden(model, num_tokens)
        for _, tensor in sorted(received.tensors.items()):
            torch.distributed.recv(
                tensor, self.group.prev_rank, group=self.group.device_group
            )
        return received

    def send_hidden(self, tensors: IntermediateTensors) -> None:
        """Device side: this stage's tensors to the next (blocking: the next
        stage's forward, in the same order, receives them)."""
        for _, tensor in sorted(tensors.tensors.items()):
            self.group.send(tensor.contiguous())

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Device side: the last stage's sampled tokens, on every stage
        (``tokens``: the last stage's, or a buffer of their shape)."""
        return self.group.broadcast(tokens, src=self.group.world_size - 1)


def empty_hidden(model: Any, num_tokens: int) -> IntermediateTensors:
    """A stage's intermediate tensors at ``num_tokens``, zeros."""
    dtype = next(model.parameters()).dtype
    return model.make_empty_intermediate_tensors(num_tokens, dtype, torch.device("cpu"))


class ReceivingStage(TokensStep):
    """Not the first stage: the forward starts from the previous stage's
    intermediate tensors (its input ids are read, and unused)."""

    def run_model_on_device(self, ctx: "StepContext") -> Any:
        stage = ctx.stage
        assert stage is not None
        received = stage.receive_hidden(ctx.model, self.inputs.layout.num_tokens_padded)
        return self.run_model_with(ctx, received)


class SendingStage(TokensStep):
    """Not the last stage: the forward ends by sending its intermediate
    tensors on; it has no logits, and its sampling receives the last stage's
    tokens into its token table."""

    def forward_on_device(
        self, ctx: "StepContext", prompt_logprobs_jobs: "list[PromptLogprobsJob]"
    ) -> None:
        """Decode rows' ids from the token table, the model, the send. The
        prompt logprobs are the last stage's (it has the logits)."""
        stage = ctx.stage
        assert stage is not None
        with torch.inference_mode():
            ctx.token_table.gather(self.inputs.input_ids, self.inputs.gather)
            stage.send_hidden(self.run_model_on_device(ctx))

    def sample_on_device(
        self,
        ctx: "StepContext",
        logits: None,
        metadata: "SamplingMetadata",
        needs_histories: bool,
        grammar: "StepMasks | None",
    ) -> Sampled:
        stage = ctx.stage
        assert stage is not None
        inputs = self.inputs
        tokens = torch.empty(inputs.sample_slots.shape, dtype=torch.int32)
        stage.share_tokens(tokens)
        ctx.token_table.write(inputs.sample_slots, tokens)
        return Sampled(tokens, None)


class SamplingStage(TokensStep):
    """The last stage: samples, then sends the tokens to every stage."""

    def sample_on_device(
        self,
        ctx: "StepContext",
        logits: torch.Tensor,
        metadata: "SamplingMetadata",
        needs_histories: bool,
        grammar: "StepMasks | None",
    ) -> Sampled:
        stage = ctx.stage
        assert stage is not None
        sampled = super().sample_on_device(
            ctx, logits, metadata, needs_histories, grammar
        )
        stage.share_tokens(sampled.tokens)
        return sampled


def stage_kinds(kinds: StepKinds, stage: PipelineStage) -> StepKinds:
    """``kinds`` as this stage runs them: each kind with the stage's part
    mixed in before it."""
    parts: list[type] = []
    if not stage.is_last:
        parts.append(SendingStage)
    if not stage.is_first:
        parts.append(ReceivingStage)
    if stage.is_last:
        parts.append(SamplingStage)

    def staged(kind: type | None) -> Any:
        if kind is None:
            return None
        return type(kind.__name__, (*parts, kind), {})

    return StepKinds(
        staged(kinds.prefill),
        staged(kinds.decode),
        staged(kinds.mixed),
        kinds.no_mixed_reason,
    )
