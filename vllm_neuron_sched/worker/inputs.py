"""Host-side inputs of one step, padded to a static shape.

Every tensor here is freshly allocated per step: the device thread may still be
running the previous step while the next one is built, so nothing it reads may
be a view of the persistent input batch.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.worker.async_flow import PAD_SLOT

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.async_flow import DeviceTokens
    from vllm_neuron_sched.worker.buckets import Buckets

# Token placeholder in host state for a sampled token still on the device.
PLACEHOLDER_TOKEN_ID = -1
# Slot for padded tokens: the KV cache write skips it.
PAD_SLOT_ID = -1


@dataclass
class StepInputs:
    # [num_reqs] request ids, in input-batch row order (the output order).
    req_ids: list[str]
    shape: BatchShape
    # [num_reqs] tokens scheduled per row.
    num_scheduled: np.ndarray
    # [num_reqs] num_computed_tokens per row before this step.
    num_computed: np.ndarray
    num_tokens: int  # real tokens
    num_tokens_padded: int  # the static shape run on the device
    # [num_tokens_padded] int32; padded entries 0. Decode rows' entries are
    # overwritten on the device from the token table (below).
    input_ids: torch.Tensor
    # Decode rows: [num_decode] int64 positions in input_ids, and the token
    # slots to read them from; None when no row decodes.
    device_token_positions: torch.Tensor | None
    device_token_slots: torch.Tensor | None
    # [num_tokens_padded] int64; padded entries 0.
    positions: torch.Tensor
    # [num_reqs] int64: the row's last token, whose logits are sampled.
    logits_indices: torch.Tensor
    # [num_reqs] True where the row reaches the end of its known tokens and so
    # samples; False for a prompt chunk that is not the last.
    is_sampled: np.ndarray
    # Per attention group: the plain metadata the backend's builder turns
    # into its own on the device thread (build_attention_metadata).
    attn_inputs: "list[tuple[AttentionGroup, CommonAttentionMetadata]]"
    # layer name -> [num_tokens_padded] int64 KV slot (padded: PAD_SLOT_ID).
    slot_mapping: dict[str, torch.Tensor]
    # [num_reqs] int64 token slot each row's sampled token is written to
    # (PAD_SLOT for rows that do not sample).
    sample_slots: torch.Tensor
    # [num_reqs] the rows' token slots (for history repairs).
    token_slots: np.ndarray
    # A non-decode input token is a placeholder: host state is behind the
    # device there (not expected; the runner waits and rebuilds).
    needs_host_tokens: bool

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_table_rows(self) -> int:
        """Decode rows whose input id the forward reads from the token table."""
        positions = self.device_token_positions
        return 0 if positions is None else int(positions.shape[0])

    @property
    def has_samples(self) -> bool:
        return bool(self.is_sampled.any())


def build_step_inputs(
    batch: "InputBatch",
    num_scheduled_tokens: dict[str, int],
    buckets: "Buckets",
    attn_groups: "list[AttentionGroup]",
    tokens: "DeviceTokens",
) -> StepInputs:
    """Inputs for the rows of ``batch`` (already updated for this step)."""
    num_reqs = batch.num_reqs
    req_ids = list(batch.req_ids)
    token_slots = tokens.slots(req_ids)
    num_scheduled = np.array([num_scheduled_tokens[r] for r in req_ids], np.int32)
    num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
    num_known = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
    num_prompt = batch.num_prompt_tokens[:num_reqs]

    is_decode_row = (num_scheduled == 1) & (num_computed + 1 == num_known)
    is_decode_row &= num_computed >= num_prompt
    shape = BatchShape.of((~is_decode_row).tolist())
    num_tokens = int(num_scheduled.sum())
    if shape is BatchShape.DECODE:
        num_tokens_padded = buckets.pad_decode(num_reqs)
    else:
        num_tokens_padded = buckets.pad_tokens(num_tokens)

    cu_num_tokens = np.cumsum(num_scheduled)
    row_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
    offset_in_row = (
        np.arange(num_tokens) - (cu_num_tokens - num_scheduled)[row_of_token]
    )
    positions_np = num_computed[row_of_token] + offset_in_row

    token_ids = batch.token_ids_cpu[row_of_token, positions_np]
    # A decode row's one token is its newest: read it from the device table.
    decode_rows = np.flatnonzero(is_decode_row)
    device_token_positions = device_token_slots = None
    if decode_rows.size:
        decode_positions = cu_num_tokens[decode_rows] - 1
        device_token_positions = torch.from_numpy(decode_positions.astype(np.int64))
        device_token_slots = torch.from_numpy(token_slots[decode_rows])
        token_ids[decode_positions] = 0
    input_ids = torch.zeros(num_tokens_padded, dtype=torch.int32)
    input_ids[:num_tokens] = torch.from_numpy(token_ids)
    is_sampled = num_computed + num_scheduled >= num_known
    positions = torch.zeros(num_tokens_padded, dtype=torch.int64)
    positions[:num_tokens] = torch.from_numpy(positions_np)

    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.from_numpy(cu_num_tokens)
    seq_lens_np = num_computed + num_scheduled
    seq_lens = torch.from_numpy(seq_lens_np.astype(np.int32))

    attn_inputs: list[tuple[AttentionGroup, CommonAttentionMetadata]] = []
    slot_mapping: dict[str, torch.Tensor] = {}
    for group in attn_groups:
        gid = group.kv_cache_group_id
        block_table = batch.block_table[gid]
        block_size = block_table.block_size
        table_np = block_table.get_numpy_array()
        kv_slots = torch.full((num_tokens_padded,), PAD_SLOT_ID, dtype=torch.int64)
        block_numbers = table_np[row_of_token, positions_np // block_size]
        kv_slots[:num_tokens] = torch.from_numpy(
            block_numbers.astype(np.int64) * block_size + positions_np % block_size
        )
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens_np.max()),
            block_table_tensor=torch.from_numpy(table_np[:num_reqs].copy()),
            slot_mapping=kv_slots,
            positions=positions[:num_tokens],
        )
        attn_inputs.append((group, common))
        for layer_name in group.layer_names:
            slot_mapping[layer_name] = kv_slots

    return StepInputs(
        req_ids=req_ids,
        shape=shape,
        num_scheduled=num_scheduled,
        num_computed=num_computed,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        input_ids=input_ids,
        device_token_positions=device_token_positions,
        device_token_slots=device_token_slots,
        positions=positions,
        logits_indices=torch.from_numpy(cu_num_tokens.astype(np.int64) - 1),
        is_sampled=is_sampled,
        attn_inputs=attn_inputs,
        slot_mapping=slot_mapping,
        sample_slots=torch.from_numpy(np.where(is_sampled, token_slots, PAD_SLOT)),
        token_slots=token_slots,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
    )


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
