"""The device token table, and the programs that read and write it.

Every sampling execution writes each sampling row's token into the table, one
entry (token slot) per request in the batch. A later step's decode rows take
their input ids from it on the device, so step N's tokens are step N+1's
input ids without a host round trip whatever happens to the batch in between
(joins, finishes, aborts, reorders, prompt chunks of others). The host
decides which input positions read which slots and which prompt tokens enter
which histories (``plan_forward_ids``); the forward's first program reads and
writes them (``forward_ids``).

The table's programs are functions of tensors like the programs around the
forward (``worker/programs.py``), at shapes fixed at start-up: the table's
own (a slot per request the scheduler may run, and the spare) and a step's
(its token count, its rows). The table's tensors come first and are written
in place; the ``compiled`` device compiles each program per declared shape.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_neuron_sched.worker.programs import Programs

# A sampled token in a host history while it is still only on the device.
PLACEHOLDER_TOKEN_ID = -1
# Slot 0 is the spare slot: rows that sample nothing (padding, prompt chunks
# that are not the last) write their token there, and nothing reads it.
SPARE_TOKEN_SLOT = 0
# A forward token whose input id is the host's, not the table's.
HOST_TOKEN = -1


@dataclass(frozen=True)
class ForwardIds:
    """Per token of a step's padded input ids: the slot its id comes from
    (``HOST_TOKEN``: the host's), and the slot whose history its id enters
    (a prompt token; the spare slot for the others)."""

    read_slots: torch.Tensor  # [num_tokens_padded] int64
    write_slots: torch.Tensor  # [num_tokens_padded] int64


@dataclass(frozen=True)
class PrefixWrites:
    """Rows that join with a prefix-cache hit, and the tokens it covers,
    which they do not run but the penalties and the n-gram proposer read."""

    slots: torch.Tensor  # [rows] int64
    ids: torch.Tensor  # [rows, history_len] int32, the hit's first
    counts: torch.Tensor  # [rows] int64


class SlotDrafts(NamedTuple):
    """What a verify step and a proposer read of their rows' slots, [rows]
    first: the newest token, the tokens known, the drafts and their count."""

    newest: torch.Tensor  # [rows] int32
    lengths: torch.Tensor  # [rows] int64
    drafts: torch.Tensor  # [rows, K] int32, 0 past their counts
    counts: torch.Tensor  # [rows] int64


def history_width(max_model_len: int, num_drafts: int) -> int:
    """Columns of the device histories: every position a token can take."""
    return max_model_len + 1 + num_drafts


def plan_forward_ids(
    num_tokens_padded: int,
    token_index: np.ndarray,
    row_of_token: np.ndarray,
    is_decode_row: np.ndarray,
    last_token_index: np.ndarray,
    token_slots: np.ndarray,
) -> ForwardIds:
    """Host side: each decode row's one input id (its newest token, at
    ``last_token_index[row]`` in the padded step) is read from the row's
    slot; every other real token is a prompt token, which enters its row's
    history at its position."""
    read_slots = np.full(num_tokens_padded, HOST_TOKEN, np.int64)
    decode_rows = np.flatnonzero(is_decode_row)
    read_slots[last_token_index[decode_rows]] = token_slots[decode_rows]
    write_slots = np.full(num_tokens_padded, SPARE_TOKEN_SLOT, np.int64)
    is_prompt = ~is_decode_row[row_of_token]
    write_slots[token_index[is_prompt]] = token_slots[row_of_token[is_prompt]]
    return ForwardIds(torch.from_numpy(read_slots), torch.from_numpy(write_slots))


# ---- the programs (device side): the table's tensors first, in place ------


def forward_ids(
    table: torch.Tensor,
    history: torch.Tensor,
    host_ids: torch.Tensor,
    positions: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> torch.Tensor:
    """[tokens] the forward's input ids: a decode token's from the table,
    the others the host's; the prompt tokens enter their histories."""
    from_table = table[read_slots.clamp(min=0)].to(host_ids.dtype)
    ids = torch.where(read_slots >= 0, from_table, host_ids)
    columns = positions.clamp(min=0, max=history.shape[1] - 1)
    history[write_slots, columns] = ids.to(history.dtype)
    return ids


def write_prefix(
    history: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
) -> None:
    """Each row's first ``counts`` tokens of ``ids`` into its history, at a
    fixed shape: the entries past a row's count into the spare slot."""
    rows = _rows_or_spare(slots, counts, ids.shape[1])
    history[rows, torch.arange(ids.shape[1]).expand_as(rows)] = ids


def accept_tokens(
    table: torch.Tensor,
    history: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Each row's first ``counts`` of ``tokens`` [rows, W] enter its history
    at ``starts``; the last of them is the newest token. Every entry is
    written, at a fixed shape: those past a row's count into the spare slot,
    which nothing reads."""
    width = tokens.shape[1]
    columns = starts[:, None] + torch.arange(width)
    rows = _rows_or_spare(slots, counts, width)
    history[rows, columns.clamp(max=history.shape[1] - 1)] = tokens.to(history.dtype)
    lengths[slots] = starts + counts
    newest = tokens.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    table[slots] = newest.to(table.dtype)


def _rows_or_spare(
    slots: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """[rows, width]: each row's slot for its first ``counts`` entries, the
    spare slot past them (a write at a fixed shape that keeps only those)."""
    keep = torch.arange(width)[None, :] < counts[:, None]
    return torch.where(keep, slots[:, None], SPARE_TOKEN_SLOT)


def read_histories(
    history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, L] the slots' histories (garbage past their lengths), and
    [rows] their lengths: copies."""
    return history[slots], lengths[slots]


def read_drafts(
    table: torch.Tensor,
    lengths: torch.Tensor,
    drafts: torch.Tensor,
    draft_counts: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """``SlotDrafts``' fields for the slots: copies."""
    return table[slots], lengths[slots], drafts[slots], draft_counts[slots]


def set_drafts(
    drafts: torch.Tensor,
    draft_counts: torch.Tensor,
    slots: torch.Tensor,
    new: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """A proposer's drafts [rows, K] for the slots, ``counts`` of them real."""
    drafts[slots] = new.to(drafts.dtype)
    draft_counts[slots] = counts


class DeviceTokens:
    """The newest sampled token of every request in the batch, on the device,
    one entry per token slot (host state assigns the slots: ``TokenSlots``).

    Each slot also keeps the request's whole token history (prompt and
    outputs, ``history_len`` columns) and its length: the sampling program's
    penalties read it, because under async scheduling the host's history
    still ends in placeholders. With speculative decoding the slot also
    keeps the drafts proposed from it (``spec/``): a verify step's input
    ids, positions and KV slots come from here, because neither the host nor
    the scheduler knows yet how many drafts the step before was accepted.

    Only device executions touch the table (``forward_ids`` in a forward,
    ``accept`` in a step's sampling or verification, the reads in the rules,
    a verify step and a proposer, in enqueue order), so the host never
    reads, writes or resizes storage an execution may be using. Its size is
    fixed at start-up: a slot per request the scheduler may run
    (``TokenSlots``), and the spare. Every read and write runs as one of
    ``programs`` (eager, or compiled per declared shape on the compiled
    device).
    """

    def __init__(
        self,
        capacity: int,
        history_len: int,
        num_drafts: int = 0,
    ) -> None:
        self.history_len = history_len
        self.num_slots = slots = capacity + 1
        # Not inference tensors, wherever the runner is made: the programs
        # that read and write them are compiled for tensors of this kind.
        with torch.inference_mode(False):
            self._table = torch.zeros(slots, dtype=torch.int32)  # device-owned
            # Device-owned, like the table: [slots, L] token ids, [slots]
            # tokens known; speculative decoding only: [slots, K] drafts,
            # [slots] drafts.
            self._history = torch.zeros((slots, history_len), dtype=torch.int32)
            self._lengths = torch.zeros(slots, dtype=torch.int64)
            self._drafts = torch.zeros((slots, num_drafts), dtype=torch.int32)
            self._draft_counts = torch.zeros(slots, dtype=torch.int64)
        from vllm_neuron_sched.worker.programs import EAGER  # it runs ours

        self.programs: Programs = EAGER

    # ---- device side: called inside device executions only ----------------

    def forward_ids(
        self,
        host_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: ForwardIds,
        prefix: PrefixWrites | None,
    ) -> torch.Tensor:
        """The forward's first act: a joining row's prefix-cache hit into
        its history, then its input ids (``forward_ids``)."""
        if prefix is not None:
            self.programs.write_prefix(
                self._history, prefix.slots, prefix.ids, prefix.counts
            )
        return self.programs.forward_ids(
            self._table,
            self._history,
            host_ids,
            positions,
            plan.read_slots,
            plan.write_slots,
        )

    # ---- histories, and speculative decoding's drafts (device side too) ----

    def histories_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, L] int32 the slots' histories, garbage past their
        lengths; [rows] int64 the lengths): copies (``read_histories``)."""
        return self.programs.read_histories(self._history, self._lengths, slots)

    def drafts_of(self, slots: torch.Tensor) -> SlotDrafts:
        """What a verify step or a proposer reads: copies (``read_drafts``)."""
        return SlotDrafts(
            *self.programs.read_drafts(
                self._table, self._lengths, self._drafts, self._draft_counts, slots
            )
        )

    def set_drafts(
        self, slots: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """A proposer's drafts [rows, K] for the slots, ``counts`` of them real."""
        self.programs.set_drafts(
            self._drafts, self._draft_counts, slots, drafts.to(torch.int32), counts
        )

    def accept(
        self,
        slots: torch.Tensor,
        starts: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Each row's first ``counts`` of ``tokens`` [rows, W] enter its
        history at ``starts`` (``accept_tokens``). A step's sampling accepts
        its one token per row (``accept_sampled``)."""
        self.programs.accept_tokens(
            self._table,
            self._history,
            self._lengths,
            slots,
            starts,
            tokens.to(torch.int32),
            counts,
        )

    def accept_sampled(
        self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """A step's sampling: each row's one token [rows] at ``positions``
        (rows that sample nothing point at the spare slot)."""
        self.accept(slots, positions, tokens[:, None], torch.ones_like(slots))
