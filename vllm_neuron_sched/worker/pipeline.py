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
across ranks; the host thread never touches the pipeline group. The
transfers are programs (``worker/programs.py``: ``receive_hidden``,
``send_hidden``, ``share_tokens``) over three operators registered with
torch, so a compiler traces them whole at the declared shapes, as vLLM's
own collectives are (its ``all_reduce`` is an operator of that kind too).
"""

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

    from vllm_neuron_sched.worker.programs import Programs

# The pipeline groups the operators below name (vLLM's unique names).
_GROUPS: "weakref.WeakValueDictionary[str, GroupCoordinator]" = (
    weakref.WeakValueDictionary()
)


@torch.library.custom_op("vllm_neuron_sched::stage_receive", mutates_args=())
def stage_receive(like: torch.Tensor, group_name: str) -> torch.Tensor:
    """From the previous stage, a tensor of ``like``'s shape and dtype."""
    group = _GROUPS[group_name]
    received = torch.empty_like(like)
    torch.distributed.recv(received, group.prev_rank, group=group.device_group)
    return received


@stage_receive.register_fake
def _(like: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(like)


# Declared as writing ``tensor``: an operator with no output that writes
# nothing is dead code to a compiler, which would drop the send.
@torch.library.custom_op("vllm_neuron_sched::stage_send", mutates_args=("tensor",))
def stage_send(tensor: torch.Tensor, group_name: str) -> None:
    """To the next stage, blocking until it receives."""
    group = _GROUPS[group_name]
    torch.distributed.send(
        tensor.contiguous(), group.next_rank, group=group.device_group
    )


@stage_send.register_fake
def _(tensor: torch.Tensor, group_name: str) -> None:
    return None


@torch.library.custom_op("vllm_neuron_sched::stage_broadcast", mutates_args=())
def stage_broadcast(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """The last stage's ``tensor``, on every stage (a copy)."""
    group = _GROUPS[group_name]
    shared = tensor.clone()
    torch.distributed.broadcast(shared, src=group.ranks[-1], group=group.device_group)
    return shared


@stage_broadcast.register_fake
def _(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


# ---- the programs (device side) -----------------------------------------------


def receive_hidden(like: torch.Tensor, group_name: str) -> torch.Tensor:
    """One of the previous stage's intermediate tensors, ``[tokens, ...]``."""
    return torch.ops.vllm_neuron_sched.stage_receive(like, group_name)


def send_hidden(tensor: torch.Tensor, group_name: str) -> None:
    """One of this stage's intermediate tensors, to the next."""
    torch.ops.vllm_neuron_sched.stage_send(tensor, group_name)


def share_tokens(tokens: torch.Tensor, group_name: str) -> torch.Tensor:
    """The last stage's sampled tokens, ``[rows]``, on every stage."""
    return torch.ops.vllm_neuron_sched.stage_broadcast(tokens, group_name)


class OneStage:
    """No pipeline: the forward starts from the input ids and ends in
    logits, and the step samples its own tokens."""

    is_first = True
    is_last = True
    is_pipeline = False

    def receive_hidden(self, model: Any, num_tokens: int, programs: "Programs") -> None:
        return None

    def send_hidden(self, tensors: IntermediateTensors, programs: "Programs") -> None:
        raise AssertionError("one stage is the last: it has logits")

    def share_tokens(self, tokens: torch.Tensor, programs: "Programs") -> torch.Tensor:
        return tokens


ONE_STAGE = OneStage()


@dataclass(frozen=True)
class PipelineStage:
    """This rank's place in the pipeline (vLLM's pipeline group)."""

    group: "GroupCoordinator"
    is_pipeline = True

    def __post_init__(self) -> None:
        _GROUPS[self.name] = self.group  # what the operators name

    @property
    def name(self) -> str:
        return self.group.unique_name

    @property
    def is_first(self) -> bool:
        return self.group.is_first_rank

    @property
    def is_last(self) -> bool:
        return self.group.is_last_rank

    def receive_hidden(
        self, model: Any, num_tokens: int, programs: "Programs"
    ) -> IntermediateTensors | None:
        """Device side: a stage after the first starts from the previous
        stage's tensors, at the step's shape, by name (no metadata; its
        input ids are read, and unused)."""
        if self.is_first:
            return None
        shapes = empty_hidden(model, num_tokens).tensors
        return IntermediateTensors(
            {
                name: programs.receive_hidden(like, self.name)
                for name, like in sorted(shapes.items())
            }
        )

    def send_hidden(self, tensors: IntermediateTensors, programs: "Programs") -> None:
        """Device side: a stage before the last ends its forward by sending
        its tensors to the next (blocking: the next stage's forward, in the
        same order, receives them)."""
        for _, tensor in sorted(tensors.tensors.items()):
            programs.send_hidden(tensor, self.name)

    def share_tokens(self, tokens: torch.Tensor, programs: "Programs") -> torch.Tensor:
        """Device side: the last stage's sampled tokens, on every stage
        (``tokens``: the last stage's, or a buffer of their shape)."""
        return programs.share_tokens(tokens, self.name)


Stage = OneStage | PipelineStage


def empty_hidden(model: Any, num_tokens: int) -> IntermediateTensors:
    """A stage's intermediate tensors at ``num_tokens``, zeros."""
    dtype = next(model.parameters()).dtype
    return model.make_empty_intermediate_tensors(num_tokens, dtype, torch.device("cpu"))
