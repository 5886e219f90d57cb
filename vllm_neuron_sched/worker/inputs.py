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
    ForwardIds,
    PrefixWrites,
    plan_forward_ids,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.core.prefill_shapes import PrefillShape
    from vllm_neuron_sched.worker.logits_rules import RowRules
    from vllm_neuron_sched.worker.steps import StepRows


@dataclass
class StepInputs:
    """A step's tensors at its padded shape (``layout.num_tokens_padded``)."""

    # [num_reqs] request ids, in input-batch row order (the output order).
    req_ids: list[str]
    # Where each row's tokens sit; positions, attention metadata, KV slots.
    layout: Layout
    # [num_tokens_padded] int32; padded entries 0. Decode rows' entries are
    # overwritten on the device from the token table (``forward_ids``).
    input_ids: torch.Tensor
    # Which tokens' ids come from the token table (decode rows'), and which
    # enter the device histories (prompt tokens).
    forward_ids: ForwardIds
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
    # The prefix-cache hits of rows that join with one; None: no such row.
    prefix_writes: PrefixWrites | None
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
    history_len: int,
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
        forward_ids=plan_forward_ids(
            layout.num_tokens_padded,
            tokens.index,
            tokens.row_of_token,
            rows.is_decode_row,
            last_token_index,
            token_slots,
        ),
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
        prefix_writes=_prefix_writes(
            batch, num_cached_prompt_tokens, token_slots, history_len
        ),
        rules=rules,
        needs_host_tokens=bool((token_ids == PLACEHOLDER_TOKEN_ID).any()),
        num_table_rows=len(decode_rows),
        has_samples=bool(is_sampled.any()),
    )


def _prefix_writes(
    batch: "InputBatch",
    num_cached_prompt_tokens: np.ndarray,
    token_slots: np.ndarray,
    history_len: int,
) -> PrefixWrites | None:
    """The tokens a joining row's prefix-cache hit covers, which it does not
    run but the penalties and the n-gram proposer read, at the histories'
    width."""
    hit_rows = np.flatnonzero(num_cached_prompt_tokens)
    if not hit_rows.size:
        return None
    ids = np.zeros((len(hit_rows), history_len), np.int32)
    width = min(history_len, batch.token_ids_cpu.shape[1])
    ids[:, :width] = batch.token_ids_cpu[hit_rows, :width]
    return PrefixWrites(
        slots=torch.from_numpy(token_slots[hit_rows]),
        ids=torch.from_numpy(ids),
        counts=torch.from_numpy(num_cached_prompt_tokens[hit_rows]),
    )
