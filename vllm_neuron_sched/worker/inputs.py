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

from vllm_neuron_sched.worker.layout import Layout, Tokens
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
    from vllm_neuron_sched.worker.logits_rules import RowRules
    from vllm_neuron_sched.worker.steps import StepRows

# (token slots, positions, token ids) a step writes into the device histories.
HistoryWrites = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    # [num_reqs] int64 where each row's sampled token goes in its history:
    # the tokens it has once the step has run.
    next_positions: torch.Tensor
    # [num_reqs] int64 the requests' prompt lengths (the repetition penalty
    # counts the prompt, the others the outputs).
    prompt_lens: torch.Tensor
    # The prompt tokens the step writes into the device histories; None
    # when every row decodes (its input is already there).
    history_writes: HistoryWrites | None
    # What the host planned of the rows' logits rules (``plan_rules``).
    rules: "RowRules"
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
    num_cached_prompt_tokens: np.ndarray,
    rules: "RowRules",
) -> StepInputs:
    """The inputs of ``rows`` at ``shape`` (``Layout.of``): prompt tokens
    from the host, each decode row's one token (its newest) from the device
    table; ``rules``: the rows' (``plan_rules``)."""
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
    num_reqs = len(rows.req_ids)
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
        next_positions=torch.from_numpy(
            (rows.num_computed + num_scheduled).astype(np.int64)
        ),
        prompt_lens=torch.from_numpy(
            batch.num_prompt_tokens[:num_reqs].astype(np.int64)
        ),
        history_writes=None
        if rows.is_decode_row.all()
        else _history_writes(
            batch, num_cached_prompt_tokens, token_slots, tokens, rows.is_decode_row
        ),
        rules=rules,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
        num_table_rows=len(decode_rows),
        has_samples=bool(is_sampled.any()),
    )


def _history_writes(
    batch: "InputBatch",
    num_cached_prompt_tokens: np.ndarray,
    token_slots: np.ndarray,
    tokens: Tokens,
    is_decode_row: np.ndarray,
) -> HistoryWrites:
    """Every prompt token the step runs (a decode row's input is in its
    history already, and on the host maybe still a placeholder), and a new
    request's prefix-cache hit, which it does not run but the penalties and
    the n-gram proposer read."""
    hit_rows = np.flatnonzero(num_cached_prompt_tokens)
    hits = num_cached_prompt_tokens[hit_rows]
    hit_rows_of_token = np.repeat(hit_rows, hits)
    hit_positions = np.arange(int(hits.sum())) - np.repeat(np.cumsum(hits) - hits, hits)
    is_prompt = ~is_decode_row[tokens.row_of_token]
    rows = np.concatenate([hit_rows_of_token, tokens.row_of_token[is_prompt]])
    columns = np.concatenate([hit_positions, tokens.positions[is_prompt]])
    return (
        torch.from_numpy(token_slots[rows]),
        torch.from_numpy(columns),
        torch.from_numpy(batch.token_ids_cpu[rows, columns].astype(np.int32)),
    )
