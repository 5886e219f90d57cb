"""Where a step's queries sit in its padded static shape, and the attention
sequences that describe them: the one place rows, offsets, positions, KV
slots and block tables are computed, for every step kind, in torch.

A step's queries are *sequences* (``Sequences``): each query's position and
sequence, whether it writes KV, each sequence's query and total length.
Two shapes of them:

- *packed*: rows back to back, each its own sequence, padded at the tail; the
  padding is outside every sequence and writes no KV. Decode steps, mixed
  steps, prefill steps at a packed shape.
- *rectangular* ``[rows, width]``: row i is one sequence of ``width`` queries
  at consecutive positions from its start, its first queries real; padded
  queries come after every real one, write no KV (``NO_KV_SLOT``) and read
  only blocks of their row or the null block 0; padded rows sit at positions
  ``0 .. width - 1``; their outputs are dropped. A prefill step at a
  rectangular shape ``[rows, tokens]`` (the host lays it out), a verify step
  ``[decode bucket, 1 + K]`` and the draft model's proposal forwards (the
  device does, from the lengths it holds).

Everything returned is freshly allocated: the device may still run the
previous step while the host lays out this one (the ownership rule).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_neuron_sched.core.prefill_shapes import PrefillShape

if TYPE_CHECKING:
    import numpy as np
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    # Per attention group, the plain metadata its builder turns into its own.
    AttentionInputs = list[tuple[AttentionGroup, CommonAttentionMetadata]]

# KV slot of a query that writes no KV: the KV cache write skips it.
NO_KV_SLOT = -1


@dataclass(frozen=True)
class BlockTable:
    """One KV cache group's block table for a step's rows: the step's own
    copy, since the input batch changes while the device runs."""

    block_size: int
    rows: torch.Tensor  # [>= the step's real rows, columns]


# KV cache group id -> its block table.
BlockTables = dict[int, BlockTable]


def block_tables(batch: "InputBatch", num_rows: int) -> BlockTables:
    """Host side: the first ``num_rows`` rows of every group's table."""
    return {
        group_id: BlockTable(
            table.block_size,
            torch.from_numpy(table.get_numpy_array()[:num_rows].copy()),
        )
        for group_id, table in enumerate(batch.block_table.block_tables)
    }


@dataclass(frozen=True)
class Sequences:
    """A step's queries as attention sequences."""

    positions: torch.Tensor  # [num_tokens_padded] int64
    seq_of_query: torch.Tensor  # [num_tokens_padded] int64 (padding: any)
    writes_kv: torch.Tensor  # [num_tokens_padded] bool
    query_lens: torch.Tensor  # [num_seqs] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    num_actual_tokens: int  # the queries attention runs (a prefix)

    def model_positions(self, max_model_len: int) -> torch.Tensor:
        """The positions the model runs: padded queries of a rectangle may
        reach past the model's (they write no KV and nothing reads them)."""
        return self.positions.clamp(max=max_model_len - 1)

    def attention(
        self, groups: "list[AttentionGroup]", tables: BlockTables
    ) -> "tuple[AttentionInputs, dict[str, torch.Tensor]]":
        """Per attention group, the plain metadata; per layer, the KV slots.
        A query writes no KV where ``writes_kv`` is False or its block is
        the null block 0 (the table does not hold its position yet)."""
        query_start_loc = torch.zeros(len(self.query_lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(self.query_lens, 0)
        seq_lens = self.seq_lens.to(torch.int32)
        max_seq_len = int(self.seq_lens.max())
        attn_inputs: AttentionInputs = []
        slot_mapping: dict[str, torch.Tensor] = {}
        for group in groups:
            table = tables[group.kv_cache_group_id]
            block_table, kv_slots = self._slots(table, max_seq_len)
            common = CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                query_start_loc_cpu=query_start_loc,
                seq_lens=seq_lens,
                num_reqs=len(self.query_lens),
                num_actual_tokens=self.num_actual_tokens,
                max_query_len=int(self.query_lens.max()),
                max_seq_len=max_seq_len,
                block_table_tensor=block_table,
                slot_mapping=kv_slots,
                positions=self.positions[: self.num_actual_tokens],
            )
            attn_inputs.append((group, common))
            for layer_name in group.layer_names:
                slot_mapping[layer_name] = kv_slots
        return attn_inputs, slot_mapping

    def _slots(
        self, table: BlockTable, max_seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The table widened to every sequence and position (padding: the
        null block), and each query's KV slot."""
        block_size, rows = table.block_size, table.rows
        num_seqs, num_real = len(self.query_lens), min(len(self.query_lens), len(rows))
        columns = max(rows.shape[1], cdiv(max_seq_len, block_size))
        widened = torch.zeros((num_seqs, columns), dtype=rows.dtype)
        widened[:num_real, : rows.shape[1]] = rows[:num_real]
        block = widened[self.seq_of_query, self.positions // block_size].long()
        kv_slots = torch.where(
            self.writes_kv & (block != 0),
            block * block_size + self.positions % block_size,
            NO_KV_SLOT,
        )
        return widened, kv_slots


def rectangle(
    num_rows_padded: int, width: int, starts: torch.Tensor, num_real: torch.Tensor
) -> Sequences:
    """``[num_rows_padded, width]`` queries: row i (of ``len(starts)``) at
    positions ``starts[i]`` on, its first ``num_real[i]`` queries real."""
    rows = len(starts)
    offsets = torch.arange(width, dtype=torch.int64)
    positions = offsets.repeat(num_rows_padded, 1)
    positions[:rows] += starts[:, None]
    writes_kv = torch.zeros((num_rows_padded, width), dtype=torch.bool)
    writes_kv[:rows] = offsets[None, :] < num_real[:, None]
    return Sequences(
        positions=positions.flatten(),
        seq_of_query=torch.arange(num_rows_padded).repeat_interleave(width),
        writes_kv=writes_kv.flatten(),
        query_lens=torch.full((num_rows_padded,), width, dtype=torch.int64),
        seq_lens=positions[:, -1] + 1,
        num_actual_tokens=num_rows_padded * width,
    )


@dataclass(frozen=True)
class Layout:
    """Host side: the rows of a step whose tokens the host lays out, in
    its padded shape."""

    num_scheduled: torch.Tensor  # [num_reqs] int64 tokens each row runs
    row_offsets: torch.Tensor  # [num_reqs] int64 each row's first token
    num_tokens_padded: int  # the static shape run on the device
    tokens: "Tokens"  # the real tokens
    sequences: Sequences

    @classmethod
    def packed(
        cls, num_scheduled: "np.ndarray", num_computed: "np.ndarray", num_padded: int
    ) -> "Layout":
        scheduled, computed = _tensors(num_scheduled, num_computed)
        offsets = torch.cumsum(scheduled, 0) - scheduled
        tokens = Tokens.of(scheduled, computed, offsets)
        num_tokens = len(tokens.positions)
        positions = torch.zeros(num_padded, dtype=torch.int64)
        positions[:num_tokens] = tokens.positions
        seq_of_query = torch.zeros(num_padded, dtype=torch.int64)
        seq_of_query[:num_tokens] = tokens.row_of_token
        sequences = Sequences(
            positions=positions,
            seq_of_query=seq_of_query,
            writes_kv=torch.arange(num_padded) < num_tokens,
            query_lens=scheduled,
            seq_lens=computed + scheduled,
            num_actual_tokens=num_tokens,
        )
        return cls(scheduled, offsets, num_padded, tokens, sequences)

    @classmethod
    def of_prefill(
        cls,
        shape: PrefillShape,
        num_scheduled: "np.ndarray",
        num_computed: "np.ndarray",
    ) -> "Layout":
        """A prefill step at its declared shape, packed or rectangular."""
        if shape.packed:
            return cls.packed(num_scheduled, num_computed, shape.size)
        scheduled, computed = _tensors(num_scheduled, num_computed)
        offsets = torch.arange(len(scheduled), dtype=torch.int64) * shape.tokens
        tokens = Tokens.of(scheduled, computed, offsets)
        sequences = rectangle(shape.rows, shape.tokens, computed, scheduled)
        return cls(scheduled, offsets, shape.size, tokens, sequences)


@dataclass(frozen=True)
class Tokens:
    """A step's real tokens, in row order."""

    row_of_token: torch.Tensor  # [num_tokens] int64 the row each belongs to
    positions: torch.Tensor  # [num_tokens] int64 position in its sequence
    index: torch.Tensor  # [num_tokens] int64 where each sits in the padded step

    @classmethod
    def of(
        cls,
        num_scheduled: torch.Tensor,
        num_computed: torch.Tensor,
        row_offsets: torch.Tensor,
    ) -> "Tokens":
        row_of_token = torch.repeat_interleave(num_scheduled)
        starts = torch.cumsum(num_scheduled, 0) - num_scheduled
        offset_in_row = torch.arange(len(row_of_token)) - starts[row_of_token]
        return cls(
            row_of_token,
            num_computed[row_of_token] + offset_in_row,
            row_offsets[row_of_token] + offset_in_row,
        )


def _tensors(*arrays: "np.ndarray") -> list[torch.Tensor]:
    """int64 tensors of the host's arrays (copies: they may be live)."""
    return [torch.tensor(array, dtype=torch.int64) for array in arrays]
