"""Where a step's queries sit in its padded static shape, and the attention
sequences that describe them: the one place rows, offsets, positions, KV
slots and block tables are computed, for every step kind. The sequences,
their KV slots and block tables are torch, host and device alike; the host's
arithmetic for a packed step (``Layout``, ``Tokens``) is numpy, since it
indexes the host's numpy arrays and costs a fraction of torch's there.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    """A step's queries as attention sequences, and their KV slots."""

    positions: torch.Tensor  # [num_tokens_padded] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    num_actual_tokens: int  # the queries attention runs (a prefix)
    max_query_len: int
    # Every sequence's length is at most this: the longest's on the host, a
    # bound fixed at start-up on the device (no host read, section 9).
    max_seq_len: int
    # KV cache group id -> the block table of every sequence and position
    # ([num_seqs, columns]) and each query's KV slot ([num_tokens_padded]:
    # ``NO_KV_SLOT`` where it writes none).
    kv_slots: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def model_positions(self, max_model_len: int) -> torch.Tensor:
        """The positions the model runs: padded queries of a rectangle may
        reach past the model's (they write no KV and nothing reads them).
        Every position is below ``max_seq_len``."""
        if self.max_seq_len <= max_model_len:
            return self.positions
        return self.positions.clamp(max=max_model_len - 1)

    def attention(
        self, groups: "list[AttentionGroup]"
    ) -> "tuple[AttentionInputs, dict[str, torch.Tensor]]":
        """Per attention group, the plain metadata; per layer, the KV slots."""
        attn_inputs: AttentionInputs = []
        slot_mapping: dict[str, torch.Tensor] = {}
        for group in groups:
            block_table, kv_slots = self.kv_slots[group.kv_cache_group_id]
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc,
                query_start_loc_cpu=self.query_start_loc,
                seq_lens=self.seq_lens,
                num_reqs=len(self.seq_lens),
                num_actual_tokens=self.num_actual_tokens,
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                block_table_tensor=block_table,
                slot_mapping=kv_slots,
                positions=self.positions[: self.num_actual_tokens],
            )
            attn_inputs.append((group, common))
            for layer_name in group.layer_names:
                slot_mapping[layer_name] = kv_slots
        return attn_inputs, slot_mapping


def step_table(table: BlockTable, num_seqs: int, max_seq_len: int) -> torch.Tensor:
    """The table of a step's ``num_seqs`` sequences, for every position
    below ``max_seq_len``: the rows it has (``table.rows`` is already the
    step's own copy), widened and padded with the null block 0. On the
    device ``max_seq_len`` is the token table's width, past the input
    batch's columns: a fixed shape."""
    rows = table.rows
    columns = max(rows.shape[1], cdiv(max_seq_len, table.block_size))
    if len(rows) >= num_seqs and columns == rows.shape[1]:
        return rows[:num_seqs]
    block_table = torch.zeros((num_seqs, columns), dtype=rows.dtype)
    num_real = min(num_seqs, len(rows))
    block_table[:num_real, : rows.shape[1]] = rows[:num_real]
    return block_table


def kv_slots_of(
    positions: torch.Tensor,
    block: torch.Tensor,
    writes_kv: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Each query's KV slot in its ``block``: none where it writes no KV or
    the block is the null block 0 (the table does not hold that position
    yet)."""
    kv_slots = torch.add(positions % block_size, block, alpha=block_size)
    return kv_slots.masked_fill(~writes_kv | (block == 0), NO_KV_SLOT)


def rectangle_queries(
    starts: torch.Tensor,
    num_real: torch.Tensor,
    block_table: torch.Tensor,
    width: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A program (``worker/programs.py``): ``[rows, width]`` queries, row i
    at positions ``starts[i]`` on, its first ``num_real[i]`` real; each
    query's KV slot from its row's ``block_table`` (``[rows, columns]``, past
    every position), and each row's sequence length. A padded row (start 0,
    no real query, null blocks) sits at ``0 .. width - 1`` and writes no KV."""
    offsets = torch.arange(width, device=starts.device)
    positions = starts[:, None] + offsets
    writes_kv = offsets < num_real[:, None]
    block = block_table.gather(1, positions // block_size)
    kv_slots = kv_slots_of(positions, block, writes_kv, block_size)
    return positions, kv_slots, (positions[:, -1] + 1).to(torch.int32)


def rectangle(
    num_rows_padded: int,
    width: int,
    starts: torch.Tensor,
    num_real: torch.Tensor,
    tables: BlockTables,
    max_seq_len: int,
    queries: Callable[..., Any] = rectangle_queries,
) -> Sequences:
    """``[num_rows_padded, width]`` queries: row i (of ``len(starts)``) at
    positions ``starts[i]`` on, its first ``num_real[i]`` queries real;
    ``max_seq_len`` bounds every row's ``start + width``. On the device
    ``queries`` is the step's program (``Programs.rectangle_queries``), run
    at the decode bucket: the rows past ``len(starts)`` enter as padding."""
    starts = _zero_rows(starts, num_rows_padded)
    num_real = _zero_rows(num_real, num_rows_padded)
    kv_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for group_id, table in tables.items():
        block_table = step_table(table, num_rows_padded, max_seq_len)
        # The positions and lengths are the same for every group.
        positions, slots, seq_lens = queries(
            starts, num_real, block_table, width, table.block_size
        )
        kv_slots[group_id] = (block_table, slots.flatten())
    num_tokens = num_rows_padded * width
    return Sequences(
        positions=positions.flatten(),
        query_start_loc=torch.arange(0, num_tokens + 1, width, dtype=torch.int32),
        seq_lens=seq_lens,
        num_actual_tokens=num_tokens,
        max_query_len=width,
        max_seq_len=max_seq_len,
        kv_slots=kv_slots,
    )


def _zero_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """``values`` then zeros, to ``rows`` rows."""
    if len(values) == rows:
        return values
    padded = values.new_zeros(rows)
    padded[: len(values)] = values
    return padded


@dataclass(frozen=True)
class Layout:
    """Host side: the rows of a step whose tokens the host lays out, in its
    padded shape, and what its forward reads for attention. The arithmetic
    of where tokens sit is numpy's (it indexes the host's arrays, and small
    numpy operations cost the host a fraction of torch's); the ``sequences``
    are the tensors every step kind's attention reads."""

    num_scheduled: np.ndarray  # [num_reqs] int64 tokens each row runs
    row_offsets: np.ndarray  # [num_reqs] int64 each row's first token
    num_tokens_padded: int  # the static shape run on the device
    tokens: "Tokens"  # the real tokens
    sequences: Sequences
    # [num_tokens_padded] int64, the positions the model runs.
    positions: torch.Tensor
    # Per attention group, the plain metadata the backend's builder turns
    # into its own on the device thread (``device_forward``).
    attn_inputs: "AttentionInputs"
    # layer name -> [num_tokens_padded] int64 KV slot (padded: NO_KV_SLOT).
    slot_mapping: dict[str, torch.Tensor]
    # The step's own block tables (a draft model's forwards read them too).
    tables: BlockTables

    @classmethod
    def of(
        cls,
        shape: PrefillShape | int,
        num_scheduled: np.ndarray,
        num_computed: np.ndarray,
        batch: "InputBatch",
        groups: "list[AttentionGroup]",
        max_model_len: int,
    ) -> "Layout":
        """``shape``: a declared prefill shape, packed or rectangular, or a
        token count the rows are packed into (decode and mixed steps)."""
        tables = block_tables(batch, len(num_scheduled))
        if isinstance(shape, int) or shape.packed:
            size = shape if isinstance(shape, int) else shape.size
            offsets = np.cumsum(num_scheduled) - num_scheduled
            tokens = Tokens.of(num_scheduled, num_computed, offsets)
            sequences = _packed(
                num_scheduled, num_computed, offsets, tokens, size, tables
            )
        else:
            size = shape.size
            offsets = np.arange(len(num_scheduled), dtype=np.int64) * shape.tokens
            tokens = Tokens.of(num_scheduled, num_computed, offsets)
            sequences = rectangle(
                shape.rows,
                shape.tokens,
                torch.from_numpy(num_computed),
                torch.from_numpy(num_scheduled),
                tables,
                int(num_computed.max()) + shape.tokens,
            )
        attn_inputs, slot_mapping = sequences.attention(groups)
        return cls(
            num_scheduled,
            offsets,
            size,
            tokens,
            sequences,
            sequences.model_positions(max_model_len),
            attn_inputs,
            slot_mapping,
            tables,
        )


def _packed(
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    offsets: np.ndarray,
    tokens: "Tokens",
    num_padded: int,
    tables: BlockTables,
) -> Sequences:
    """Rows back to back, the padding at position 0 of row 0, writing no KV."""
    num_tokens = len(tokens.positions)
    positions = np.zeros(num_padded, dtype=np.int64)
    positions[:num_tokens] = tokens.positions
    seq_of_query = np.zeros(num_padded, dtype=np.int64)
    seq_of_query[:num_tokens] = tokens.row_of_token
    query_start_loc = np.zeros(len(num_scheduled) + 1, dtype=np.int32)
    query_start_loc[1:] = offsets + num_scheduled
    seq_lens = (num_computed + num_scheduled).astype(np.int32)
    max_seq_len = int(seq_lens.max())
    query_positions = torch.from_numpy(positions)
    query_seqs = torch.from_numpy(seq_of_query)
    writes_kv = torch.from_numpy(np.arange(num_padded) < num_tokens)
    kv_slots = {}
    for group_id, table in tables.items():
        block_size = table.block_size
        block_table = step_table(table, len(seq_lens), max_seq_len)
        block = block_table[query_seqs, query_positions // block_size]
        slots = kv_slots_of(query_positions, block, writes_kv, block_size)
        kv_slots[group_id] = (block_table, slots)
    return Sequences(
        positions=query_positions,
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=int(num_scheduled.max()),
        max_seq_len=max_seq_len,
        kv_slots=kv_slots,
    )


@dataclass(frozen=True)
class Tokens:
    """A step's real tokens, in row order."""

    row_of_token: np.ndarray  # [num_tokens] the row each belongs to
    positions: np.ndarray  # [num_tokens] int64 position in its sequence
    index: np.ndarray  # [num_tokens] where each sits in the padded step

    @classmethod
    def of(
        cls,
        num_scheduled: np.ndarray,
        num_computed: np.ndarray,
        row_offsets: np.ndarray,
    ) -> "Tokens":
        num_rows = len(num_scheduled)
        if (num_scheduled == 1).all():  # a token a row: a decode step
            return cls(np.arange(num_rows), num_computed.copy(), row_offsets)
        row_of_token = np.repeat(np.arange(num_rows), num_scheduled)
        # Token j in row order is the (j - first)-th of its row, ``first``
        # the row's first token in row order.
        first = np.cumsum(num_scheduled) - num_scheduled
        order = np.arange(len(row_of_token))
        return cls(
            row_of_token,
            order + (num_computed - first)[row_of_token],
            order + (row_offsets - first)[row_of_token],
        )
