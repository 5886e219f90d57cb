"""Pipeline parallel: this rank's stage (``PipelineStage``), which the step
kinds consult at its three seams (``worker/steps.py``): where the forward
starts, where it ends, and where the sampled tokens come from. One stage
(``ONE_STAGE``) is a pipeline whose only stage is first and last.

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

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator


class OneStage:
    """No pipeline: the forward starts from the input ids and ends in
    logits, and the step samples its own tokens."""

    is_first = True
    is_last = True
    is_pipeline = False

    def receive_hidden(self, model: Any, num_tokens: int) -> None:
        return None

    def send_hidden(self, tensors: IntermediateTensors) -> None:
        raise AssertionError("one stage is the last: it has logits")

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


ONE_STAGE = OneStage()


@dataclass(frozen=True)
class PipelineStage:
    """This rank's place in the pipeline (vLLM's pipeline group)."""

    group: "GroupCoordinator"
    is_pipeline = True

    @property
    def is_first(self) -> bool:
        return self.group.is_first_rank

    @property
    def is_last(self) -> bool:
        return self.group.is_last_rank

    def receive_hidden(self, model: Any, num_tokens: int) -> IntermediateTensors | None:
        """Device side: a stage after the first starts from the previous
        stage's tensors, received into buffers of the step's shape (one
        allocation, no metadata; its input ids are read, and unused)."""
        if self.is_first:
            return None
        received = empty_hidden(model, num_tokens)
        for _, tensor in sorted(received.tensors.items()):
            torch.distributed.recv(
                tensor, self.group.prev_rank, group=self.group.device_group
            )
        return received

    def send_hidden(self, tensors: IntermediateTensors) -> None:
        """Device side: a stage before the last ends its forward by sending
        its tensors to the next (blocking: the next stage's forward, in the
        same order, receives them)."""
        for _, tensor in sorted(tensors.tensors.items()):
            self.group.send(tensor.contiguous())

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Device side: the last stage's sampled tokens, on every stage
        (``tokens``: the last stage's, or a buffer of their shape)."""
        return self.group.broadcast(tokens, src=self.group.world_size - 1)


Stage = OneStage | PipelineStage


def empty_hidden(model: Any, num_tokens: int) -> IntermediateTensors:
    """A stage's intermediate tensors at ``num_tokens``, zeros."""
    dtype = next(model.parameters()).dtype
    return model.make_empty_intermediate_tensors(num_tokens, dtype, torch.device("cpu"))
