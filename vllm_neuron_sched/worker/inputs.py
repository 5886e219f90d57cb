"""Host side: a step's rows as the scheduler decided them (``StepRows``), and
the padded tensors of a step whose tokens the host lays out (``StepInputs``,
``token_inputs``; where they sit: ``layout.py``).

Every tensor here is freshly allocated per step: the device thread may still be
running the previous step while the next one is built, so nothing it reads may
be a view of the persistent input batch.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.worker.layout import BlockTables, Layout, block_tables
from vllm_neuron_sched.worker.token_table import (
    PLACEHOLDER_TOKEN_ID,
    SPARE_TOKEN_SLOT,
    TableGather,
    plan_gather,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.host_state import StepUpdate
    from vllm_neuron_sched.worker.layout import AttentionInputs


@dataclass(frozen=True)
class StepRows:
    """The step's rows as the scheduler decided them, and what each does."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # [num_reqs] tokens scheduled
    num_computed: np.ndarray  # [num_reqs] tokens computed before the step
    # [num_reqs] tokens known as the scheduler counts them (prompt, outputs,
    # in-flight placeholders): a row decodes when it runs the newest.
    num_known: np.ndarray
    num_drafts: np.ndarray  # [num_reqs] drafts scheduled (0 unless speculating)
    # [num_reqs] True: the row runs its newest token (and drafts), its input
    # id from the token table; False: prompt tokens the host holds.
    is_decode_row: np.ndarray
    shape: BatchShape

    @classmethod
    def of(
        cls,
        batch: "InputBatch",
        scheduler_output: "SchedulerOutput",
        update: "StepUpdate",
    ) -> "StepRows":
        """``batch``: already updated for this step, as ``update`` tells."""
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = np.array([scheduled[r] for r in req_ids], np.int64)
        num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], np.int64)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        num_known = update.scheduled_num_tokens
        is_decode_row = (
            (num_scheduled == 1 + num_drafts)
            & (num_computed + 1 == num_known)
            & (num_computed >= update.prompt_lens)
        )
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


@dataclass
class StepInputs:
    """A step's tensors at its padded shape (``num_tokens_padded``)."""

    # [num_reqs] request ids, in input-batch row order (the output order).
    req_ids: list[str]
    num_tokens_padded: int
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
    # into its own on the device thread (``device_forward``).
    attn_inputs: "AttentionInputs"
    # layer name -> [num_tokens_padded] int64 KV slot (padded: NO_KV_SLOT).
    slot_mapping: dict[str, torch.Tensor]
    # The step's own block tables (a draft model's forwards read them too).
    tables: BlockTables
    # [num_reqs] int64 token slot each row's sampled token is written to
    # (SPARE_TOKEN_SLOT for rows that do not sample).
    sample_slots: torch.Tensor
    # [num_reqs] the rows' token slots (for history repairs).
    token_slots: np.ndarray
    # A non-decode input token is a placeholder: host state is behind the
    # device there (not expected; the runner waits and rebuilds).
    needs_host_tokens: bool
    # Decode rows whose input id the forward reads from the token table.
    num_table_rows: int
    # Some row samples (else the step's last execution is its forward).
    has_samples: bool


def token_inputs(
    batch: "InputBatch",
    rows: StepRows,
    layout: Layout,
    token_slots: np.ndarray,
    attn_groups: "list[AttentionGroup]",
    max_model_len: int,
) -> StepInputs:
    """The inputs of ``rows`` at ``layout``: prompt tokens from the host,
    each decode row's one token (its newest) from the device table."""
    tokens, num_scheduled = layout.tokens, layout.num_scheduled
    # Each row's last token: the one it samples from; a decode row's only.
    last_token_index = layout.row_offsets + num_scheduled - 1
    decode_rows = np.flatnonzero(rows.is_decode_row)
    gather = plan_gather(decode_rows, last_token_index, token_slots)
    token_ids = batch.token_ids_cpu[tokens.row_of_token, tokens.positions]
    token_ids[np.cumsum(num_scheduled)[decode_rows] - 1] = 0
    input_ids = torch.zeros(layout.num_tokens_padded, dtype=torch.int32)
    input_ids[torch.from_numpy(tokens.index)] = torch.from_numpy(token_ids)
    is_sampled = rows.num_computed + num_scheduled >= rows.num_known
    tables = block_tables(batch, len(rows.req_ids))
    attn_inputs, slot_mapping = layout.sequences.attention(attn_groups, tables)
    return StepInputs(
        req_ids=rows.req_ids,
        num_tokens_padded=layout.num_tokens_padded,
        row_offsets=layout.row_offsets,
        input_ids=input_ids,
        gather=gather,
        positions=layout.sequences.model_positions(max_model_len),
        logits_indices=torch.from_numpy(last_token_index),
        is_sampled=is_sampled,
        attn_inputs=attn_inputs,
        slot_mapping=slot_mapping,
        tables=tables,
        sample_slots=torch.from_numpy(
            np.where(is_sampled, token_slots, SPARE_TOKEN_SLOT)
        ),
        token_slots=token_slots,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
        num_table_rows=len(decode_rows),
        has_samples=bool(is_sampled.any()),
    )
