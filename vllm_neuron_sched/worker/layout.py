"""Where a step's tokens sit in its padded static shape, and the attention
sequences that describe them: the one place rows, offsets, positions, KV
slots and block tables are computed for the steps the host lays out.

Two layouts. A prefill step at a rectangular prefill shape ``[rows, tokens]``
is *rectangular*: row i's chunk sits at ``[i * tokens, i * tokens + chunk)``,
padded to ``tokens``, and rows past the group are padding. Each row is one
attention sequence of ``tokens`` queries that starts at the row's computed
tokens, so a real query sees exactly its own prefix (causal), padded queries
come after every real one, write no KV (``NO_KV_SLOT``) and read only blocks
of their row or the null block 0; their outputs are dropped. Every other step
is *packed*: rows back to back, each its own attention sequence, padded at the
tail, the padding outside every sequence and writing no KV.

Host side, numpy. Everything returned is freshly allocated: the device may
still run the previous step while this one is laid out (the ownership rule).
"""

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_neuron_sched.core.prefill_shapes import PrefillShape

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    # Per attention group, the plain metadata its builder turns into its own.
    AttentionInputs = list[tuple[AttentionGroup, CommonAttentionMetadata]]

# KV slot of padded tokens: the KV cache write skips it.
NO_KV_SLOT = -1


@dataclass(frozen=True)
class Layout:
    """The rows of one step in its padded shape."""

    num_scheduled: np.ndarray  # [num_reqs] tokens each row runs
    num_computed: np.ndarray  # [num_reqs] tokens computed before the step
    row_offsets: np.ndarray  # [num_reqs] int64 each row's first token
    num_tokens_padded: int  # the static shape run on the device
    # A rectangular prefill shape (None: packed).
    rectangle: PrefillShape | None = None

    @classmethod
    def packed(
        cls, num_scheduled: np.ndarray, num_computed: np.ndarray, num_padded: int
    ) -> "Layout":
        offsets = (np.cumsum(num_scheduled) - num_scheduled).astype(np.int64)
        return cls(num_scheduled, num_computed, offsets, num_padded)

    @classmethod
    def of_prefill(
        cls, shape: PrefillShape, num_scheduled: np.ndarray, num_computed: np.ndarray
    ) -> "Layout":
        """A prefill step at its declared shape, packed or rectangular."""
        if shape.packed:
            return cls.packed(num_scheduled, num_computed, shape.size)
        offsets = np.arange(len(num_scheduled), dtype=np.int64) * shape.tokens
        return cls(num_scheduled, num_computed, offsets, shape.size, shape)

    @cached_property
    def tokens(self) -> "Tokens":
        """The step's real tokens, in row order (computed once: the inputs and
        a speculating prefill step's history writes both read them)."""
        num_scheduled = self.num_scheduled
        num_tokens = int(num_scheduled.sum())
        starts = np.cumsum(num_scheduled) - num_scheduled
        row_of_token = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
        offset_in_row = np.arange(num_tokens) - starts[row_of_token]
        return Tokens(
            row_of_token,
            self.num_computed[row_of_token] + offset_in_row,
            self.row_offsets[row_of_token] + offset_in_row,
        )

    def attention(
        self,
        table_np: np.ndarray,
        block_size: int,
        kv_slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> CommonAttentionMetadata:
        """One KV cache group's plain attention metadata (its block table a
        copy: the input batch's changes while the device runs)."""
        num_reqs = len(self.num_scheduled)
        shape = self.rectangle
        if shape is None:  # packed: the real tokens only
            query_lens = self.num_scheduled.astype(np.int64)
            seq_lens_np = self.num_computed + query_lens
            block_table = table_np[:num_reqs]
            num_actual_tokens = int(query_lens.sum())
        else:  # every row, padded rows too, is ``tokens`` queries long
            query_lens = np.full(shape.rows, shape.tokens, dtype=np.int64)
            seq_lens_np = query_lens.copy()
            seq_lens_np[:num_reqs] += self.num_computed
            # Padded queries reach past the row's blocks: the null block 0.
            width = max(table_np.shape[1], cdiv(int(seq_lens_np.max()), block_size))
            block_table = np.zeros((shape.rows, width), dtype=table_np.dtype)
            block_table[:num_reqs, : table_np.shape[1]] = table_np[:num_reqs]
            num_actual_tokens = shape.size
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.from_numpy(np.cumsum(query_lens))
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)),
            num_reqs=len(query_lens),
            num_actual_tokens=num_actual_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens_np.max()),
            block_table_tensor=torch.from_numpy(np.array(block_table, copy=True)),
            slot_mapping=kv_slots,
            positions=positions[:num_actual_tokens],
        )


@dataclass(frozen=True)
class Tokens:
    """A step's real tokens, in row order."""

    row_of_token: np.ndarray  # [num_tokens] the row each token belongs to
    positions: np.ndarray  # [num_tokens] int64 position in its sequence
    index: np.ndarray  # [num_tokens] where each sits in the padded step


def attention_inputs(
    batch: "InputBatch",
    attn_groups: "list[AttentionGroup]",
    layout: Layout,
    tokens: Tokens,
    positions: torch.Tensor,
) -> "tuple[AttentionInputs, dict[str, torch.Tensor]]":
    """Per KV cache group, the plain attention metadata; per layer, the KV
    slots (padded tokens: ``NO_KV_SLOT``)."""
    attn_inputs: AttentionInputs = []
    slot_mapping: dict[str, torch.Tensor] = {}
    index = torch.from_numpy(tokens.index)
    for group in attn_groups:
        block_table = batch.block_table[group.kv_cache_group_id]
        block_size = block_table.block_size
        table_np = block_table.get_numpy_array()
        kv_slots = torch.full(
            (layout.num_tokens_padded,), NO_KV_SLOT, dtype=torch.int64
        )
        block_numbers = table_np[tokens.row_of_token, tokens.positions // block_size]
        kv_slots[index] = torch.from_numpy(
            block_numbers.astype(np.int64) * block_size + tokens.positions % block_size
        )
        attn_inputs.append(
            (group, layout.attention(table_np, block_size, kv_slots, positions))
        )
        for layer_name in group.layer_names:
            slot_mapping[layer_name] = kv_slots
    return attn_inputs, slot_mapping
