"""A step's rectangle of queries (``layout.rectangle``): where each query
sits, which KV slot it writes, at the decode bucket and at a bound fixed at
start-up, eager and compiled alike."""

import pytest
import torch

from vllm_neuron_sched.worker.layout import (
    NO_KV_SLOT,
    BlockTable,
    rectangle,
    rectangle_queries,
)

BLOCK_SIZE = 4
BOUND = 20  # every start + width is at most this: 5 block columns


def _rectangle(queries=rectangle_queries):
    """Two real rows in a bucket of 4, 3 queries each: row 0 from position 5
    (its first 2 real), row 1 from position 2 (all 3 real, the third in a
    block the table does not hold yet: the null block 0). Their tables are 2
    columns wide, as the host copied them."""
    table = BlockTable(BLOCK_SIZE, torch.tensor([[3, 7], [9, 0]], dtype=torch.int32))
    return rectangle(
        4,
        3,
        torch.tensor([5, 2]),
        torch.tensor([2, 3]),
        {0: table},
        BOUND,
        queries,
    )


def test_a_rectangles_queries_their_kv_slots_and_its_padding() -> None:
    sequences = _rectangle()
    assert sequences.positions.tolist() == [5, 6, 7, 2, 3, 4, 0, 1, 2, 0, 1, 2]
    block_table, kv_slots = sequences.kv_slots[0]
    # Padded to the bucket and widened to the bound with the null block.
    assert block_table.tolist() == [
        [3, 7, 0, 0, 0],
        [9, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    none = NO_KV_SLOT
    assert kv_slots.tolist() == [
        7 * 4 + 1, 7 * 4 + 2, none,  # row 0's third query is not real
        9 * 4 + 2, 9 * 4 + 3, none,  # position 4 is in block 0
        none, none, none,  # padded rows write nothing
        none, none, none,
    ]  # fmt: skip
    assert sequences.seq_lens.tolist() == [8, 5, 3, 3]
    assert sequences.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert sequences.max_seq_len == BOUND
    # Positions past the model's are clamped where the model runs them.
    assert sequences.model_positions(6).tolist()[:3] == [5, 5, 5]


def test_the_compiled_program_answers_as_the_eager_one() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(
        rectangle_queries, fullgraph=True, dynamic=False, backend="eager"
    )
    eager, traced = _rectangle(), _rectangle(compiled)
    assert torch.equal(eager.positions, traced.positions)
    assert torch.equal(eager.seq_lens, traced.seq_lens)
    for ours, theirs in zip(eager.kv_slots[0], traced.kv_slots[0], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("rows", [1, 4])
def test_a_full_bucket_takes_the_rows_as_they_are(rows: int) -> None:
    table = BlockTable(BLOCK_SIZE, torch.ones(rows, 5, dtype=torch.int32))
    sequences = rectangle(
        rows,
        1,
        torch.arange(rows),
        torch.ones(rows, dtype=torch.int64),
        {0: table},
        BOUND,
    )
    assert sequences.positions.tolist() == list(range(rows))
    assert sequences.kv_slots[0][1].tolist() == [4 + r for r in range(rows)]
