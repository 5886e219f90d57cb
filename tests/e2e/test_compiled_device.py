"""The compiled device (``VLLM_NEURON_SCHED_DEVICE=compiled``): the forward
compiled at start-up once per declared shape, async with n-gram speculation on
the device, serving stock vLLM CPU's tokens without compiling anything more
(dynamo's own cache entries for the forward, read in the worker). The graphs
run on dynamo's ``eager`` backend here (seconds to compile on 2 cores); the
benchmark's runs use inductor, vLLM's default."""

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import generate, start_in_subprocess
from vllm_neuron_sched.testing.workloads import (
    MODES,
    SMALL_ENGINE,
    STOCK_ENV,
    mixed_greedy,
    mixed_prompts,
)

pytestmark = pytest.mark.slow

# Stock's compile mode, which our runner drives per shape (the CPU platform
# would trace once with a dynamic token count).
COMPILED = {
    **{k: v for k, v in SMALL_ENGINE.items() if k != "enforce_eager"},
    "compilation_config": {"mode": 1, "backend": "eager"},
}


@pytest.fixture(scope="module", autouse=True)
def stock(checkpoint_dir: str) -> Future[list[dict[str, Any]]]:
    """Started with the module, before the compiled engine sets its device
    variable: stock's child runs while the engine compiles, in the child
    other modules' stock runs share."""
    return start_in_subprocess(
        checkpoint_dir, mixed_prompts(), _params(), SMALL_ENGINE, STOCK_ENV
    )


@pytest.fixture(scope="module")
def compiled_llm(checkpoint_dir: str) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_NEURON_SCHED_DEVICE", "compiled")
        with in_process_llm(checkpoint_dir, **COMPILED, **MODES["async_ngram"]) as llm:
            yield llm


def _params() -> list[dict[str, Any]]:
    """The mixed workload, one request with penalties and min_tokens, one
    with bad words and one with allowed tokens (the compiled rules, in the
    plain steps' sampling and the verify steps')."""
    params = mixed_greedy()
    params[2].update(
        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
    )
    params[2]["min_tokens"] = 4
    params[3]["bad_words"] = ["qu", "gu"]
    params[4]["allowed_token_ids"] = list(range(10, 700))
    return params


def test_compiled_serves_stock_tokens_without_compiling(
    compiled_llm: Any, stock: Future[list[dict[str, Any]]]
) -> None:
    (before,) = compiled_llm.collective_rpc("get_compiled_shapes")
    declared = before["declared"]
    # decode rows of 1 and 1 + K queries, prefill shapes, token buckets
    assert declared is not None and {1, 2, 4, 16, 32} <= set(declared)
    # Dynamo's graphs, an earlier engine's in this process included.
    assert before["forward_graphs"] >= len(declared)
    # Per decode bucket (1, 2, 4): for sampling greedy rows and random ones
    # with or without top-k and top-p, with or without logprobs, and the raw
    # logprobs before the rules; the rules at widths 1 and 1 + K, and for
    # rejection sampling greedy, random and truncated rows; a verify step's
    # queries at widths 1 and 1 + K (one KV cache group); the token table's:
    # a forward's ids per token count, a prefix-cache hit's tokens, accepted
    # tokens at widths 1 and 1 + K, the drafts; its reads.
    assert before["program_shapes"] == {
        "compute_logits": 5,  # 1, 2, 4 rows; 1, 2, 4 of 1 + K queries
        "sample_rows": 30,
        "raw_scores": 3,
        "accept_drafts": 18,
        "propose_ngram_drafts": 3,
        "mask_tokens": 6,
        "mask_bad_words": 6,
        "mask_min_tokens": 6,
        "add_logit_bias": 6,
        "penalize_queries": 6,
        "rectangle_queries": 6,
        "forward_ids": len(declared),
        "write_prefix": 3,
        "accept_tokens": 6,
        "set_drafts": 3,
        "read_histories": 3,
        "read_drafts": 3,
    }
    for name, shapes in before["program_shapes"].items():
        assert before["program_graphs"][name] >= shapes
    ours = generate(compiled_llm, mixed_prompts(), _params())
    (after,) = compiled_llm.collective_rpc("get_compiled_shapes")
    calls = after.pop("program_calls")
    before.pop("program_calls")
    assert after == before  # nothing compiled while serving
    # Prompts sample in the program (the rules in theirs), verify steps in
    # rejection sampling's; every step's logits from the LM head's.
    assert calls["sample_rows"] > 0 and calls["accept_drafts"] > 0
    assert calls["compute_logits"] > 0
    for rule in ("mask_tokens", "mask_bad_words", "mask_min_tokens"):
        assert calls[rule] > 0, calls
    assert calls["penalize_queries"] > 0
    assert calls["rectangle_queries"] > 0  # every verify step's queries
    # The token table is read and written in its programs only.
    for table_program in ("forward_ids", "accept_tokens", "set_drafts", "read_drafts"):
        assert calls[table_program] > 0, calls
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock.result()]
