"""Structured outputs in a verify step: each row's grammar masks over its
``1 + K`` queries, and the drafts a mask rejects."""

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.structured_output.utils import apply_grammar_bitmask

from vllm_neuron_sched.worker.spec.rejection import REJECTED

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput


@dataclass(frozen=True)
class VerifyGrammar:
    """A verify step's grammar masks, one per query of each structured row,
    and how many drafts each row may accept."""

    grammar_output: "GrammarOutput"  # the masks, padded to ``width`` per row
    layout: SimpleNamespace  # the rectangle, as vLLM's apply_grammar_bitmask reads it
    req_ids: list[str]
    draft_limit: torch.Tensor  # [num_rows] int64


def plan_grammar(
    grammar_output: "GrammarOutput",
    req_ids: list[str],
    scheduled_spec_tokens: dict[str, list[int]],
    width: int,
) -> VerifyGrammar:
    """Host side. vLLM's scheduler sends ``1 + scheduled drafts`` masks per
    structured request, mask ``j`` for the query after its first ``j``
    drafts, and how many leading drafts the grammar checked (under async
    scheduling only those it could read back: ``take_draft_token_ids``). Each
    request's masks are padded to ``width`` with permissive ones, which no
    output reads since the row's run stops at its last checked draft, so
    vLLM's ``apply_grammar_bitmask`` lays them on the ``[rows, width]``
    queries. A copy: the scheduler refills its mask buffer for the next step
    while this one runs."""
    ids = grammar_output.structured_output_request_ids
    source = grammar_output.grammar_bitmask
    acceptable = grammar_output.num_acceptable_drafts or [0] * len(ids)
    masks = np.full((len(ids) * width, source.shape[1]), -1, dtype=source.dtype)
    limit = torch.full((len(req_ids),), width - 1, dtype=torch.int64)
    row_of = {req_id: row for row, req_id in enumerate(req_ids)}
    start = 0
    for i, req_id in enumerate(ids):
        num_masks = 1 + len(scheduled_spec_tokens.get(req_id, ()))
        assert num_masks <= width, (req_id, num_masks, width)
        masks[i * width : i * width + num_masks] = source[start : start + num_masks]
        start += num_masks
        if (row := row_of.get(req_id)) is not None:
            limit[row] = acceptable[i]
    rectangle = {req_id: [REJECTED] * (width - 1) for req_id in (*req_ids, *ids)}
    return VerifyGrammar(
        replace(grammar_output, grammar_bitmask=masks),
        SimpleNamespace(scheduled_spec_decode_tokens=rectangle),
        list(req_ids),
        limit,
    )


def apply_verify_grammar(
    logits: torch.Tensor, num_drafts: torch.Tensor, grammar: VerifyGrammar
) -> torch.Tensor:
    """Device side: masks ``logits`` ([rows * width, vocab]) in place and
    returns the drafts each row may verify: no more than the grammar checked."""
    apply_grammar_bitmask(
        grammar.layout,
        grammar.grammar_output,
        SimpleNamespace(req_ids=grammar.req_ids),
        logits,
    )
    return torch.minimum(num_drafts, grammar.draft_limit)
