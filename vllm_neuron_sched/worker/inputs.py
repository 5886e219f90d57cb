"""Host-side inputs of one step, padded to a static shape.

Two layouts. A prefill step at a rectangular prefill shape ``[rows, tokens]``
is *rectangular*: row i's chunk sits at ``[i * tokens, i * tokens + chunk)``,
padded to ``tokens``, and rows past the group are padding. Each row is one
attention sequence of ``tokens`` queries that starts at the row's computed
tokens, so a real query sees exactly its own prefix (causal), padded queries
come after every real one, write no KV (slot -1) and read only blocks of their
row or the null block 0; their outputs are dropped. Every other step is
*packed*: rows back to back, each its own attention sequence, padded at the
tail, the padding outside every sequence and writing no KV. A prefill step at
a packed shape pads to the shape, a decode batch to its bucket, a step of a
scheduler that mixes to a token-count bucket.

With speculative decoding a decode step is a *verify step*
(``spec/verify.py``): rows at ``i * (1 + K)``, their inputs completed on the
device; a prefill step also writes its prompt tokens into the device
histories the n-gram proposer reads.

Every tensor here is freshly allocated per step: the device thread may still be
running the previous step while the next one is built, so nothing it reads may
be a view of the persistent input batch.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_neuron_sched.core.prefill_shapes import PrefillShape
from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.worker.spec.verify import VerifyPlan, plan_verify
from vllm_neuron_sched.worker.token_table import (
    PLACEHOLDER_TOKEN_ID,
    SPARE_TOKEN_SLOT,
    TableGather,
    plan_gather,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.buckets import Buckets
    from vllm_neuron_sched.worker.host_state import StepUpdate

# KV slot of padded tokens: the KV cache write skips it.
NO_KV_SLOT = -1


@dataclass
class StepInputs:
    # [num_reqs] request ids, in input-batch row order (the output order).
    req_ids: list[str]
    shape: BatchShape
    num_tokens_padded: int  # the static shape run on the device
    # [num_reqs] where each row's first token sits in the padded step.
    row_offsets: np.ndarray
    # [num_tokens_padded] int32; padded entries 0. Decode rows' entries are
    # overwritten on the device from the token table (``gather``).
    input_ids: torch.Tensor
    # Decode rows' input ids from the token table; None when no row decodes.
    gather: TableGather | None
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
    # layer name -> [num_tokens_padded] int64 KV slot (padded: NO_KV_SLOT).
    slot_mapping: dict[str, torch.Tensor]
    # [num_reqs] int64 token slot each row's sampled token is written to
    # (SPARE_TOKEN_SLOT for rows that do not sample).
    sample_slots: torch.Tensor
    # [num_reqs] the rows' token slots (for history repairs).
    token_slots: np.ndarray
    # A non-decode input token is a placeholder: host state is behind the
    # device there (not expected; the runner waits and rebuilds).
    needs_host_tokens: bool
    # [num_reqs] tokens each row may add to its history (placeholders): 1
    # per sampling row, 1 + drafts per verify row (and per prompt row that
    # vLLM padded with placeholder drafts), 0 otherwise.
    num_new_tokens: np.ndarray
    # Speculative decoding: a verify step's plan (its tensors above are then
    # empty: the device completes them), or for other steps the prompt
    # tokens' (slots, positions, token ids) for the device histories and each
    # row's next position (where a sampled token goes).
    verify: VerifyPlan | None = None
    history_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    next_positions: torch.Tensor | None = None

    @property
    def num_table_rows(self) -> int:
        """Decode rows whose input id the forward reads from the token table."""
        if self.verify is not None:
            return self.verify.num_rows
        return 0 if self.gather is None else self.gather.num_rows

    @property
    def has_samples(self) -> bool:
        return bool(self.is_sampled.any())

    def block_tables(self) -> dict[int, torch.Tensor]:
        """KV cache group id -> the step's block table (a row per request
        first, in row order; the step's own copy)."""
        return {
            group.kv_cache_group_id: common.block_table_tensor
            for group, common in self.attn_inputs
        }


@dataclass(frozen=True)
class _Rows:
    """The step's rows as the scheduler decided them, and what each does."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # [num_reqs] tokens scheduled
    num_computed: np.ndarray  # [num_reqs] tokens computed before the step
    num_known: np.ndarray  # [num_reqs] tokens known (prompt and outputs)
    num_drafts: np.ndarray  # [num_reqs] drafts scheduled (speculating), else []
    # [num_reqs] True: the row runs its newest token (and drafts), its input
    # id from the token table; False: prompt tokens the host holds.
    is_decode_row: np.ndarray
    shape: BatchShape

    @classmethod
    def of(
        cls,
        batch: "InputBatch",
        num_scheduled_tokens: dict[str, int],
        update: "StepUpdate",
        scheduled_drafts: dict[str, list[int]] | None,
    ) -> "_Rows":
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids)
        num_scheduled = np.array([num_scheduled_tokens[r] for r in req_ids], np.int64)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        num_known = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        num_drafts = np.zeros(0, np.int64)
        num_queries: int | np.ndarray = 1
        if scheduled_drafts is not None:
            num_drafts = np.array(
                [len(scheduled_drafts.get(r, ())) for r in req_ids], np.int64
            )
            num_queries = 1 + num_drafts
            num_known = update.scheduled_num_tokens
        is_decode_row = (num_scheduled == num_queries) & (num_computed + 1 == num_known)
        is_decode_row &= num_computed >= update.prompt_lens
        shape = BatchShape.of((~is_decode_row).tolist())
        return cls(
            req_ids,
            num_scheduled,
            num_computed,
            num_known,
            num_drafts,
            is_decode_row,
            shape,
        )


def build_step_inputs(
    batch: "InputBatch",
    num_scheduled_tokens: dict[str, int],
    buckets: "Buckets",
    attn_groups: "list[AttentionGroup]",
    update: "StepUpdate",
    scheduled_drafts: dict[str, list[int]] | None = None,
    num_spec_tokens: int = 0,
) -> StepInputs:
    """Inputs for the rows of ``batch`` (already updated for this step, as
    ``update`` tells). ``scheduled_drafts``: the scheduler's drafts per
    request, given when the engine speculates (``num_spec_tokens`` per verify
    row)."""
    rows = _Rows.of(batch, num_scheduled_tokens, update, scheduled_drafts)
    speculates = scheduled_drafts is not None
    if speculates and rows.shape is BatchShape.DECODE:
        plan = plan_verify(
            batch,
            rows.num_drafts,
            update.token_slots,
            buckets.pad_decode(len(rows.req_ids)),
            num_spec_tokens,
            attn_groups,
            update.min_tokens,
        )
        return _verify_inputs(rows, update.token_slots, plan)
    if speculates and rows.shape is BatchShape.MIXED:
        raise RuntimeError(
            "speculative decoding needs steps that never mix prefill and decode "
            "(the vllm_neuron_sched schedulers)"
        )
    return _token_inputs(batch, rows, buckets, attn_groups, update, speculates)


def _token_inputs(
    batch: "InputBatch",
    rows: _Rows,
    buckets: "Buckets",
    attn_groups: "list[AttentionGroup]",
    update: "StepUpdate",
    speculates: bool,
) -> StepInputs:
    """A step whose input tokens the host lays out: prompt chunks and decode
    rows at their padded shape."""
    token_slots = update.token_slots
    num_computed, num_known = rows.num_computed, rows.num_known
    # vLLM pads a prompt whose prefix-cache hit leaves it one token to
    # ``1 + K`` tokens with K placeholder drafts (uniform verify shapes for
    # its CUDA graphs). Such a row runs its one prompt token and samples from
    # it; the scheduler counts the placeholders as rejected drafts.
    num_padding = np.where(rows.is_decode_row, 0, rows.num_drafts) if speculates else 0
    num_scheduled = rows.num_scheduled - num_padding
    layout = _Layout.of(rows.shape, num_scheduled, num_computed, buckets)
    tokens = _Tokens.of(layout, num_computed)

    token_ids = batch.token_ids_cpu[tokens.row_of_token, tokens.positions]
    # A decode row's one token is its newest: read it from the device table.
    decode_rows = np.flatnonzero(rows.is_decode_row)
    last_token_index = layout.row_offsets + num_scheduled - 1
    gather = plan_gather(decode_rows, last_token_index, token_slots)
    token_ids[np.cumsum(num_scheduled)[decode_rows] - 1] = 0
    input_ids = torch.zeros(layout.num_tokens_padded, dtype=torch.int32)
    input_ids[tokens.index] = torch.from_numpy(token_ids)
    positions = torch.zeros(layout.num_tokens_padded, dtype=torch.int64)
    positions[tokens.index] = torch.from_numpy(tokens.positions)
    is_sampled = num_computed + num_scheduled >= num_known
    attn_inputs, slot_mapping = _attention_inputs(
        batch, attn_groups, layout, tokens, positions
    )
    return StepInputs(
        req_ids=rows.req_ids,
        shape=rows.shape,
        num_tokens_padded=layout.num_tokens_padded,
        row_offsets=layout.row_offsets,
        input_ids=input_ids,
        gather=gather,
        positions=positions,
        logits_indices=torch.from_numpy(last_token_index),
        is_sampled=is_sampled,
        attn_inputs=attn_inputs,
        slot_mapping=slot_mapping,
        sample_slots=torch.from_numpy(
            np.where(is_sampled, token_slots, SPARE_TOKEN_SLOT)
        ),
        token_slots=token_slots,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
        # As the scheduler counts them: a padded row's placeholders too.
        num_new_tokens=is_sampled.astype(np.int64) + num_padding,
        history_writes=(
            _history_writes(
                batch, update, token_slots, tokens.row_of_token, tokens.positions
            )
            if speculates
            else None
        ),
        next_positions=(
            torch.from_numpy(num_computed + num_scheduled) if speculates else None
        ),
    )


@dataclass(frozen=True)
class _Tokens:
    """The step's real tokens, in row order."""

    row_of_token: np.ndarray  # [num_tokens] the row each token belongs to
    positions: np.ndarray  # [num_tokens] int64 position in its sequence
    index: torch.Tensor  # [num_tokens] where each sits in the padded step

    @classmethod
    def of(cls, layout: "_Layout", num_computed: np.ndarray) -> "_Tokens":
        num_scheduled = layout.num_scheduled
        num_tokens = int(num_scheduled.sum())
        starts = np.cumsum(num_scheduled) - num_scheduled
        row_of_token = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
        offset_in_row = np.arange(num_tokens) - starts[row_of_token]
        return cls(
            row_of_token,
            num_computed[row_of_token] + offset_in_row,
            torch.from_numpy(layout.row_offsets[row_of_token] + offset_in_row),
        )


def _attention_inputs(
    batch: "InputBatch",
    attn_groups: "list[AttentionGroup]",
    layout: "_Layout",
    tokens: _Tokens,
    positions: torch.Tensor,
) -> "tuple[list[tuple[AttentionGroup, CommonAttentionMetadata]], dict]":
    """Per KV cache group, the plain attention metadata and each layer's KV
    slots (padded tokens: ``NO_KV_SLOT``)."""
    attn_inputs: list[tuple[AttentionGroup, CommonAttentionMetadata]] = []
    slot_mapping: dict[str, torch.Tensor] = {}
    for group in attn_groups:
        block_table = batch.block_table[group.kv_cache_group_id]
        block_size = block_table.block_size
        table_np = block_table.get_numpy_array()
        kv_slots = torch.full(
            (layout.num_tokens_padded,), NO_KV_SLOT, dtype=torch.int64
        )
        block_numbers = table_np[tokens.row_of_token, tokens.positions // block_size]
        kv_slots[tokens.index] = torch.from_numpy(
            block_numbers.astype(np.int64) * block_size + tokens.positions % block_size
        )
        attn_inputs.append(
            (group, layout.attention(table_np, block_size, kv_slots, positions))
        )
        for layer_name in group.layer_names:
            slot_mapping[layer_name] = kv_slots
    return attn_inputs, slot_mapping


def _history_writes(
    batch: "InputBatch",
    update: "StepUpdate",
    token_slots: np.ndarray,
    row_of_token: np.ndarray,
    positions: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, positions, token ids) the device histories get from a prefill
    step: every prompt token it runs, and a new request's prefix-cache hit,
    which it does not run but the n-gram proposer reads."""
    hit_rows = np.flatnonzero(update.num_cached_prompt_tokens)
    hits = update.num_cached_prompt_tokens[hit_rows]
    hit_rows_of_token = np.repeat(hit_rows, hits)
    hit_positions = np.arange(int(hits.sum())) - np.repeat(np.cumsum(hits) - hits, hits)
    rows = np.concatenate([hit_rows_of_token, row_of_token])
    columns = np.concatenate([hit_positions, positions])
    return (
        torch.from_numpy(token_slots[rows]),
        torch.from_numpy(columns),
        torch.from_numpy(batch.token_ids_cpu[rows, columns].astype(np.int32)),
    )


def _verify_inputs(
    rows: _Rows, token_slots: np.ndarray, plan: VerifyPlan
) -> StepInputs:
    """A verify step: the host's part is the plan; the device completes it."""
    num_reqs = len(rows.req_ids)
    empty = torch.zeros(0, dtype=torch.int64)
    return StepInputs(
        req_ids=rows.req_ids,
        shape=BatchShape.DECODE,
        num_tokens_padded=plan.num_tokens_padded,
        row_offsets=np.arange(num_reqs, dtype=np.int64) * plan.width,
        input_ids=empty,
        gather=None,
        positions=empty,
        logits_indices=empty,
        is_sampled=np.ones(num_reqs, dtype=bool),
        attn_inputs=[],
        slot_mapping={},
        sample_slots=plan.slots,
        token_slots=token_slots,
        needs_host_tokens=False,
        num_new_tokens=rows.num_scheduled.astype(np.int64),
        verify=plan,
    )


@dataclass(frozen=True)
class _Layout:
    """Where the rows of a step sit in its padded shape, and the attention
    sequences that describe them (see the module docstring)."""

    num_scheduled: np.ndarray  # [num_reqs]
    num_computed: np.ndarray  # [num_reqs]
    # [num_reqs] int64: each row's first token in the padded step.
    row_offsets: np.ndarray
    num_tokens_padded: int
    # The declared prefill shape of a prefill step (None for other steps).
    prefill_shape: PrefillShape | None

    @classmethod
    def of(
        cls,
        shape: BatchShape,
        num_scheduled: np.ndarray,
        num_computed: np.ndarray,
        buckets: "Buckets",
    ) -> "_Layout":
        prefill_shape = None
        if shape is BatchShape.PREFILL:
            prefill_shape = buckets.prefill_shape(num_scheduled.tolist())
        if prefill_shape is not None and not prefill_shape.packed:
            offsets = np.arange(len(num_scheduled), dtype=np.int64)
            offsets *= prefill_shape.tokens
            return cls(
                num_scheduled, num_computed, offsets, prefill_shape.size, prefill_shape
            )
        if prefill_shape is not None:
            padded = prefill_shape.size
        elif shape is BatchShape.DECODE:
            padded = buckets.pad_decode(len(num_scheduled))
        else:
            padded = buckets.pad_tokens(int(num_scheduled.sum()))
        offsets = (np.cumsum(num_scheduled) - num_scheduled).astype(np.int64)
        return cls(num_scheduled, num_computed, offsets, padded, prefill_shape)

    def attention(
        self,
        table_np: np.ndarray,
        block_size: int,
        kv_slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> CommonAttentionMetadata:
        num_reqs = len(self.num_scheduled)
        shape = self.prefill_shape
        if shape is None or shape.packed:  # packed: the real tokens only
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
            # A copy: the input batch's table changes while the device runs.
            block_table_tensor=torch.from_numpy(np.array(block_table, copy=True)),
            slot_mapping=kv_slots,
            positions=positions[:num_actual_tokens],
        )
