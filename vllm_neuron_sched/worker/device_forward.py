"""Inside a forward execution only: the attention metadata and the model call.

What runs here reads buffers the host built for this step and handed over at
enqueue (the ownership rule, docs/design.md section 5); nothing here runs on
the host, and nothing the host runs is here.
"""

from typing import TYPE_CHECKING, Any

import torch
from vllm.forward_context import set_forward_context

from vllm_neuron_sched.worker.compiled import declared_shape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sequence import IntermediateTensors
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.utils import AttentionGroup


def build_attention_metadata(
    attn_inputs: "list[tuple[AttentionGroup, CommonAttentionMetadata]]",
) -> dict[str, Any]:
    """layer name -> its backend's metadata. Device thread only: vLLM's CPU
    builder sizes the process-global scratchpad (its realloc frees the old
    buffer) that the running forward's kernels read, so it must not run on
    the host while an execution is in flight."""
    attn_metadata: dict[str, Any] = {}
    for group, common in attn_inputs:
        metadata = group.build_metadata(common)
        for layer_name in group.layer_names:
            attn_metadata[layer_name] = metadata
    return attn_metadata


def run_model(
    model: Any,
    vllm_config: "VllmConfig",
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn_inputs: "list[tuple[AttentionGroup, CommonAttentionMetadata]]",
    slot_mapping: dict[str, torch.Tensor],
    num_tokens_padded: int,
    intermediate_tensors: "IntermediateTensors | None" = None,
) -> "torch.Tensor | IntermediateTensors":
    """Device side: ``model`` (the target or a draft) at the step's padded
    shape, its attention metadata built here (section 11: never on the
    host). A pipeline stage that is not the first starts from the previous
    stage's ``intermediate_tensors``; one that is not the last returns its
    own instead of hidden states."""
    with (
        set_forward_context(
            build_attention_metadata(attn_inputs),
            vllm_config,
            num_tokens=num_tokens_padded,
            slot_mapping=slot_mapping,
        ),
        declared_shape(model, num_tokens_padded),
    ):
        if intermediate_tensors is None:
            return model(input_ids=input_ids, positions=positions)
        return model(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
        )
