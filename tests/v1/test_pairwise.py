"""The compatibility matrix's covering designs hold every pair of settings
that can run together, also where allpairspy, with a filter, leaves some out
(``testing/pairwise.py``)."""

from allpairspy import AllPairs

from vllm_neuron_sched.testing.pairwise import covering_rows, uncovered_pairs

# The engine-level matrix's factors (tests/e2e/test_engine_features.py), by
# name: the speculative mode cannot take custom logits processors.
FACTORS = [
    ["dense", "sliding_window", "moe"],
    ["sync", "async", "async_ngram"],
    ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
    ["float32", "bfloat16"],
    ["inline", "thread"],
    ["no_procs", "procs"],
]
INFEASIBLE = ((1, 5), ("async_ngram", "procs"))


def _runnable(row: list[str]) -> bool:
    return not (len(row) > 5 and row[1] == "async_ngram" and row[5] == "procs")


def test_every_runnable_pair_is_covered() -> None:
    plain = [list(row) for row in AllPairs(FACTORS, filter_func=_runnable)]
    assert len(uncovered_pairs(FACTORS, plain)) > 1  # allpairspy's gap
    rows = covering_rows(FACTORS, _runnable)
    assert uncovered_pairs(FACTORS, rows) == [INFEASIBLE]
    assert all(_runnable(row) for row in rows)
    assert len(rows) <= len(plain) + 1  # one row took both missing pairs
