"""The device n-gram proposer gives exactly the drafts of vLLM's CPU proposer.

vLLM's proposer is numba code, and numba (llvmlite) in this process breaks
vLLM's Triton-kernel override scan of ``sys.modules`` when a later test starts
a worker in-process; so it runs in a child process of its own.
"""

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from vllm_neuron_sched.worker.spec.ngram import propose_ngram_drafts

_REFERENCE = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import (
    _find_longest_matched_ngram_and_propose_tokens as find,
)
for line in sys.stdin:
    tokens, k, min_n, max_n, max_model_len = json.loads(line)
    drafts = [] if len(tokens) >= max_model_len else find(
        np.asarray(tokens, dtype=np.int32), min_n, max_n, max_model_len, k
    ).tolist()
    print(json.dumps(drafts), flush=True)
"""

VllmDrafts = Callable[[list[int], int, int, int, int], list[int]]


@pytest.fixture(scope="module")
def vllm_drafts() -> Iterator[VllmDrafts]:
    """What stock vLLM proposes for one request (``NgramProposer.propose``:
    no drafts at ``max_model_len``)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _REFERENCE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None

    def drafts(
        tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int
    ) -> list[int]:
        child.stdin.write(json.dumps([tokens, k, min_n, max_n, max_model_len]) + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    yield drafts
    child.stdin.close()
    child.wait(timeout=30)


def device_drafts(
    rows: list[list[int]],
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
    max_len: int | None = None,
) -> list[list[int]]:
    """Propose for ``rows``, stored in reversed slots with garbage past each end."""
    max_len = max_len or max(len(row) for row in rows)
    history = torch.randint(0, 7, (len(rows) + 1, max_len), dtype=torch.int32)
    slots = torch.arange(len(rows), 0, -1, dtype=torch.int64)
    for row, slot in zip(rows, slots.tolist()):
        history[slot, : len(row)] = torch.tensor(row, dtype=torch.int32)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    drafts, counts = propose_ngram_drafts(
        history[slots], lengths, k, min_n, max_n, max_model_len
    )
    assert drafts.shape == (len(rows), k) and drafts.dtype == torch.int32
    assert counts.shape == (len(rows),) and counts.dtype == torch.int64
    for draft, count in zip(drafts.tolist(), counts.tolist()):
        assert draft[count:] == [0] * (k - count)
    return [draft[:count] for draft, count in zip(drafts.tolist(), counts.tolist())]


@pytest.mark.parametrize("seed", range(40))
def test_matches_vllm_on_random_sequences(seed: int, vllm_drafts: VllmDrafts) -> None:
    rng = random.Random(seed)
    vocab = rng.randint(3, 6)
    k = rng.randint(1, 5)
    min_n = rng.randint(1, 5)
    max_n = rng.randint(min_n, 5)
    max_len = 60
    max_model_len = rng.choice([max_len, rng.randint(1, max_len + 10)])
    rows = []
    for _ in range(32):
        length = rng.choice([0, 1, 2, max_len, rng.randint(0, max_len)])
        rows.append([rng.randrange(vocab) for _ in range(length)])
    # Rows at or near the model length: the k' = max_model_len - T cap and the skip.
    tail = [rng.randrange(vocab) for _ in range(max_len)]
    rows += [tail[:max_model_len], tail[: max_model_len - 1], tail[: max_model_len - 2]]
    rows = [row[: min(max_len, max_model_len)] for row in rows]

    got = device_drafts(rows, k, min_n, max_n, max_model_len, max_len)
    for row, draft in zip(rows, got):
        assert draft == vllm_drafts(row, k, min_n, max_n, max_model_len), row


@pytest.mark.parametrize(
    "tokens, k, min_n, max_n, expected",
    [
        ([1, 2, 3, 1, 2], 3, 2, 2, [3, 1, 2]),
        ([1, 2, 3, 1, 2], 1, 2, 2, [3]),
        # The earliest occurrence of the suffix wins.
        ([1, 2, 5, 1, 2, 6, 1, 2], 2, 2, 2, [5, 1]),
        # The longest n wins over an earlier, shorter match.
        ([2, 7, 3, 1, 2, 8, 1, 2], 2, 1, 2, [8, 1]),
        # The occurrence may overlap the suffix.
        ([4, 4, 4, 4], 5, 2, 3, [4]),
        # No match, or the context shorter than min_n.
        ([1, 2, 3, 4], 3, 1, 3, []),
        ([1], 3, 1, 3, []),
        ([], 3, 1, 3, []),
        ([1, 2, 1], 3, 3, 3, []),
    ],
)
def test_hand_written_cases(
    tokens: list[int],
    k: int,
    min_n: int,
    max_n: int,
    expected: list[int],
    vllm_drafts: VllmDrafts,
) -> None:
    assert vllm_drafts(tokens, k, min_n, max_n, 100) == expected
    assert device_drafts([tokens], k, min_n, max_n, 100, max_len=8) == [expected]


def test_model_length_caps_and_skips() -> None:
    tokens = [1, 2, 3, 1, 2]
    assert device_drafts([tokens], 3, 2, 2, 7) == [[3, 1]]
    assert device_drafts([tokens], 3, 2, 2, 5) == [[]]
    assert device_drafts([tokens], 3, 2, 2, 5, max_len=5) == [[]]


def test_no_rows() -> None:
    history = torch.zeros(4, 16, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int64)
    drafts, counts = propose_ngram_drafts(history[empty], empty, 3, 1, 3, 16)
    assert drafts.shape == (0, 3) and counts.shape == (0,)
