"""Host side: the padded tensors of a step whose tokens the host lays out
(``StepInputs``, ``token_inputs``; where they sit and what attention reads:
``layout.py``).

Every tensor here is freshly allocated per step: the device thread may still be
running the previous step while the next one is built, so nothing it reads may
be a view of the persistent input batch.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron_sched.worker.layout import Layout
from vllm_neuron_sched.worker.token_table import (
    PLACEHOLDER_TOKEN_ID,
    SPARE_TOKEN_SLOT,
    TableGather,
    plan_gather,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.core.prefill_shapes import PrefillShape
    from vllm_neuron_sched.worker.steps import StepRows


@dataclass
class StepInputs:
    """A step's tensors at its padded shape (``layout.num_tokens_padded``)."""

    # [num_reqs] request ids, in input-batch row order (the output order).
    req_ids: list[str]
    # Where each row's tokens sit; positions, attention metadata, KV slots.
    layout: Layout
    # [num_tokens_padded] int32; padded entries 0. Decode rows' entries are
    # overwritten on the device from the token table (``gather``).
    input_ids: torch.Tensor
    # Decode rows' input ids from the token table; None when no row decodes.
    gather: TableGather | None
    # [num_reqs] int64: the row's last token, whose logits are sampled.
    logits_indices: torch.Tensor
    # [num_reqs] True where the row reaches the end of its known tokens and so
    # samples; False for a prompt chunk that is not the last.
    is_sampled: np.ndarray
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
    rows: "StepRows",
    shape: "PrefillShape | int",
    token_slots: np.ndarray,
    attn_groups: "list[AttentionGroup]",
    max_model_len: int,
) -> StepInputs:
    """The inputs of ``rows`` at ``shape`` (``Layout.of``): prompt tokens
    from the host, each decode row's one token (its newest) from the device
    table."""
    layout = Layout.of(
        shape, rows.num_run, rows.num_computed, batch, attn_groups, max_model_len
    )
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
    return StepInputs(
        req_ids=rows.req_ids,
        layout=layout,
        input_ids=input_ids,
        gather=gather,
        logits_indices=torch.from_numpy(last_token_index),
        is_sampled=is_sampled,
        sample_slots=torch.from_numpy(
            np.where(is_sampled, token_slots, SPARE_TOKEN_SLOT)
        ),
        token_slots=token_slots,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
        num_table_rows=len(decode_rows),
        has_samples=bool(is_sampled.any()),
    )
