"""The device token table, and the decode-id gather that reads it.

Every sampling execution writes each sampling row's token into the table, one
entry (token slot) per live request. A later step's decode rows take their
input ids from it on the device, so step N's tokens are step N+1's input ids
without a host round trip whatever happens to the batch in between (joins,
finishes, aborts, reorders, prompt chunks of others). The gather is the two
halves below: the host decides which input positions read which slots
(``plan_gather``), the forward reads them (``DeviceTokens.gather``).
"""

from dataclasses import dataclass

import numpy as np
import torch

# A sampled token in a host history while it is still only on the device.
PLACEHOLDER_TOKEN_ID = -1
# Slot 0 is the spare slot: rows that sample nothing (padding, prompt chunks
# that are not the last) write their token there, and nothing reads it.
SPARE_TOKEN_SLOT = 0


@dataclass(frozen=True)
class TableGather:
    """Which positions of a step's input ids come from which token slots."""

    positions: torch.Tensor  # [num_decode] int64, in the padded input ids
    slots: torch.Tensor  # [num_decode] int64


def history_width(max_model_len: int, num_drafts: int) -> int:
    """Columns of the device histories: every position a token can take."""
    return max_model_len + 1 + num_drafts


def plan_gather(
    decode_rows: np.ndarray, last_token_index: np.ndarray, token_slots: np.ndarray
) -> TableGather | None:
    """Host side: each decode row's one input id (its newest token, at
    ``last_token_index[row]`` in the padded step) is read from the row's slot.
    None when no row decodes."""
    if not decode_rows.size:
        return None
    return TableGather(
        positions=torch.from_numpy(last_token_index[decode_rows]),
        slots=torch.from_numpy(token_slots[decode_rows]),
    )


class DeviceTokens:
    """The newest sampled token of every live request, on the device, one
    entry per token slot (host state assigns the slots: ``TokenSlots``).

    Each slot also keeps the request's whole token history (prompt and
    outputs, ``history_len`` columns) and its length: the sampling program's
    penalties read it, because under async scheduling the host's history
    still ends in placeholders. With speculative decoding the slot also
    keeps the drafts proposed from it (``spec/``): a verify step's input
    ids, positions and KV slots come from here, because neither the host nor
    the scheduler knows yet how many drafts the step before was accepted.

    Only device executions touch the table (``gather`` in a forward,
    ``read`` and ``write`` in sampling, in enqueue order), so the host never
    reads, writes or resizes storage an execution may be using. Its size is
    fixed at start-up: a slot per request the scheduler may run
    (``TokenSlots``), and the spare.
    """

    def __init__(
        self,
        capacity: int,
        history_len: int,
        num_drafts: int = 0,
    ) -> None:
        self._table = torch.zeros(capacity + 1, dtype=torch.int32)  # device-owned
        self.history_len = history_len
        # Device-owned, like the table: [slots, L] token ids, [slots] tokens
        # known; speculative decoding only: [slots, K] drafts, [slots] drafts.
        self._history = torch.zeros((capacity + 1, history_len), dtype=torch.int32)
        self._lengths = torch.zeros(capacity + 1, dtype=torch.int64)
        self._drafts = torch.zeros((capacity + 1, num_drafts), dtype=torch.int32)
        self._draft_counts = torch.zeros(capacity + 1, dtype=torch.int64)

    # ---- device side: called inside device executions only ----------------

    def gather(self, input_ids: torch.Tensor, plan: TableGather | None) -> None:
        """The forward's first act: decode rows' input ids from the table."""
        if plan is not None:
            input_ids[plan.positions] = self._table[plan.slots]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self._table[slots]

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._table[slots] = tokens

    # ---- histories, and speculative decoding's drafts (device side too) ----

    def lengths_of(self, slots: torch.Tensor) -> torch.Tensor:
        """[rows] int64: the tokens each slot's history holds."""
        return self._lengths[slots]

    def histories_of(self, slots: torch.Tensor, end: int | None = None) -> torch.Tensor:
        """[rows, end] int32, a copy: the slots' histories (garbage past their
        lengths)."""
        return self._history[slots, :end]

    def drafts_of(self, slots: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """[rows, width] int32, a copy: the slots' drafts (0 past their counts)."""
        return self._drafts[slots, :width]

    def draft_counts_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self._draft_counts[slots]

    def set_drafts(
        self, slots: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """A proposer's drafts [rows, K] for the slots, ``counts`` of them real."""
        self._drafts[slots] = drafts.to(torch.int32)
        self._draft_counts[slots] = counts

    def record(
        self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor
    ) -> None:
        """Prompt tokens into the histories."""
        self._history[slots, positions.clamp(max=self.history_len - 1)] = ids

    def accept(
        self,
        slots: torch.Tensor,
        starts: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Each row's first ``counts`` of ``tokens`` [rows, W] enter its
        history at ``starts``; the last of them is the newest token. Every
        entry is written, at a fixed shape: those past a row's count into the
        spare slot, which nothing reads. A step's sampling accepts its one
        token per row (``accept_sampled``)."""
        width = tokens.shape[1]
        columns = starts[:, None] + torch.arange(width)
        keep = torch.arange(width)[None, :] < counts[:, None]
        rows = torch.where(keep, slots[:, None], SPARE_TOKEN_SLOT)
        self._history[rows, columns.clamp(max=self.history_len - 1)] = tokens
        self._lengths[slots] = starts + counts
        newest = tokens.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
        self._table[slots] = newest

    def accept_sampled(
        self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """A step's sampling: each row's one token [rows] at ``positions``
        (rows that sample nothing point at the spare slot)."""
        self.accept(slots, positions, tokens[:, None], torch.ones_like(slots))
