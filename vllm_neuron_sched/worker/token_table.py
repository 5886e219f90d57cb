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
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_neuron_sched.runtime import Device

# Slot 0 is the spare slot: rows that sample nothing (padding, prompt chunks
# that are not the last) write their token there, and nothing reads it.
SPARE_TOKEN_SLOT = 0


@dataclass(frozen=True)
class TableGather:
    """Which positions of a step's input ids come from which token slots."""

    positions: torch.Tensor  # [num_decode] int64, in the padded input ids
    slots: torch.Tensor  # [num_decode] int64

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


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

    Only device executions touch the table (``gather`` in a forward,
    ``read`` and ``write`` in sampling, in enqueue order), so the host never
    reads, writes or resizes storage an execution may be using; growing it
    is itself an execution.
    """

    def __init__(self, capacity: int, device: "Device") -> None:
        self._device = device
        self._table = torch.zeros(capacity + 1, dtype=torch.int32)  # device-owned

    def grow(self, capacity: int) -> None:
        """Host side: room for ``capacity`` slots, after what is queued."""
        self._device.enqueue_state_update(self._grow, capacity + 1)

    # ---- device side: called inside device executions only ----------------

    def gather(self, input_ids: torch.Tensor, plan: TableGather | None) -> None:
        """The forward's first act: decode rows' input ids from the table."""
        if plan is not None:
            input_ids[plan.positions] = self._table[plan.slots]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self._table[slots]

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._table[slots] = tokens

    def _grow(self, size: int) -> None:
        table = torch.zeros(size, dtype=torch.int32)
        table[: self._table.shape[0]] = self._table
        self._table = table
