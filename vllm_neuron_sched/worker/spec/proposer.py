"""Draft proposers behind one protocol: the n-gram proposer here, the draft
model in ``draft_model.py``. Both run on the device, after a verify step's
rejection sampling and after a prompt's first token."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from vllm_neuron_sched.worker.programs import EAGER, Programs
from vllm_neuron_sched.worker.results import Drafts
from vllm_neuron_sched.worker.spec.config import Speculation
from vllm_neuron_sched.worker.token_table import SPARE_TOKEN_SLOT

if TYPE_CHECKING:
    from vllm_neuron_sched.worker.inputs import StepInputs
    from vllm_neuron_sched.worker.layout import BlockTables
    from vllm_neuron_sched.worker.token_table import DeviceTokens


@dataclass(frozen=True)
class AcceptedTokens:
    """Device side: what a sampling execution just added to each row's
    history, for the proposer: ``tokens[r, :counts[r]]`` at positions
    ``starts[r]`` on (rows with count 0 added nothing), and each row's block
    table per KV cache group (``[>= rows, columns]``)."""

    slots: torch.Tensor  # [rows] int64
    starts: torch.Tensor  # [rows] int64
    tokens: torch.Tensor  # [rows, W] int32 (REJECTED past the counts)
    counts: torch.Tensor  # [rows] int64
    tables: "BlockTables"


class Proposer(Protocol):
    """Device side, inside a step's executions."""

    def prefill(self, inputs: "StepInputs") -> None:
        """After a prefill step's forward, with its inputs (a draft model
        runs over the same prompt tokens)."""
        ...

    def propose(self, tokens: "DeviceTokens", accepted: AcceptedTokens) -> None:
        """The next drafts of the rows in ``accepted``, into the token table
        (``DeviceTokens.set_drafts``)."""
        ...


@dataclass(frozen=True)
class NgramProposer:
    speculation: Speculation
    programs: Programs = EAGER

    def prefill(self, inputs: "StepInputs") -> None:
        """The n-gram proposer reads the histories, which the step wrote."""

    def propose(self, tokens: "DeviceTokens", accepted: AcceptedTokens) -> None:
        spec, slots = self.speculation, accepted.slots
        drafts, counts = self.programs.propose_ngram_drafts(
            *tokens.histories_of(slots),
            spec.num_tokens,
            spec.min_n,
            spec.max_n,
            spec.max_model_len,
        )
        tokens.set_drafts(slots, drafts, counts)


def after_prompt_sampling(
    proposer: Proposer,
    tokens: "DeviceTokens",
    slots: torch.Tensor,
    positions: torch.Tensor,
    sampled: torch.Tensor,
    tables: "BlockTables",
) -> Drafts:
    """Device side, after a prompt's last chunk sampled its first token (and
    the sampling put it into the history): the first drafts, so the
    request's first decode step already verifies drafts. Rows that sample
    nothing point at the spare slot and add nothing."""
    ones = torch.ones_like(positions)
    counts = torch.where(slots == SPARE_TOKEN_SLOT, 0, ones)
    proposer.propose(
        tokens, AcceptedTokens(slots, positions, sampled[:, None], counts, tables)
    )
    read = tokens.drafts_of(slots)
    return Drafts(read.drafts, read.counts)
