"""The bfloat16 noise floor: stock vLLM CPU against itself with another batch
composition.

    python -m benchmarks.bf16_floor [--model real] [--tokens 48] [--ours]

bfloat16 logits depend on the GEMM shapes a batch runs at, and ours differ
from stock's (static shapes, prefill apart from decode), so no bf16 run can
equal stock token for token everywhere. This measures how far stock moves
from itself when only the batch changes: the same greedy requests in stock
engines with the prompts in order and ``max_num_seqs`` 8, reversed and 3,
in order and 1 (each alone). It reports, against the first, over every position
before a request's two runs part, the largest difference of a logprob both
report (the *floor*), and at each parting stock's gap between its top two
logprobs. The e2e tests hold ours to it (``testing/workloads.py``:
``BF16_LOGPROB_FLOOR``, ``assert_within_bf16_floor``).
"""

import argparse
import json
from typing import Any

from vllm_neuron_sched.testing.checkpoint import (
    CACHE_DIR,
    DEFAULT_CHECKPOINT,
    CheckpointSpec,
)
from vllm_neuron_sched.testing.oracle import generate_in_subprocess
from vllm_neuron_sched.testing.workloads import NGRAM, STOCK_ENV, mixed_prompts

# Requests of real text for the real model, as ChatML user turns (its
# template's format, without a system prompt).
REAL_QUESTIONS = [
    "Repeat this sentence three times: the quick brown fox jumps over the dog.",
    "List the numbers from 1 to 20 separated by commas.",
    "Copy this table: | a | b |\n| 1 | 2 |\n| 3 | 4 |",
    "Rename the function foo to bar in: def foo(x): return foo(x-1) if x else 0",
    "Continue the list: 1. apples 2. pears 3. plums 4.",
    "Fix the typo in: The wether is nice today and the wether will be nice.",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
]


def _prompts(model: str) -> tuple[str, list[Any]]:
    if model in TINY_MODELS:
        from vllm_neuron_sched.testing.checkpoint import ensure_checkpoint

        path, spec = TINY_MODELS[model]
        return str(ensure_checkpoint(path, spec)), mixed_prompts()
    from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint

    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return str(ensure_real_checkpoint()), [chat.format(q) for q in REAL_QUESTIONS]


# The test models (tests/e2e/test_engine_features.py), made once.
TINY_MODELS: dict[str, tuple[Any, CheckpointSpec | None]] = {
    "tiny": (DEFAULT_CHECKPOINT, None),
    "sliding_window": (
        CACHE_DIR / "tiny-sliding-window",
        CheckpointSpec(sliding_window=32),
    ),
    "moe": (CACHE_DIR / "tiny-moe", CheckpointSpec(num_experts=4)),
}


def top2_gap(step: dict[str, float]) -> float:
    """Stock's gap between its two most likely tokens at one position."""
    first, second = sorted(step.values(), reverse=True)[:2]
    return first - second


def compare(ours: list[dict], stock: list[dict]) -> dict[str, Any]:
    """Per request: where the two part, the largest logprob difference
    before that, and stock's top-2 gap at the parting."""
    worst, partings = 0.0, []
    for i, (a, b) in enumerate(zip(ours, stock)):
        tokens_a, tokens_b = a["token_ids"], b["token_ids"]
        part = next(
            (k for k, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None
        )
        end = min(len(tokens_a), len(tokens_b)) if part is None else part
        for k in range(end):
            la, lb = a["logprobs"][k], b["logprobs"][k]
            for token in la.keys() & lb.keys():
                worst = max(worst, abs(la[token] - lb[token]))
        if part is not None:
            partings.append((i, part, top2_gap(b["logprobs"][part])))
    return {"max_logprob_diff": worst, "partings": partings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*TINY_MODELS, "real"], default="tiny")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--ours",
        action="store_true",
        help="also ours (async, async with n-gram speculation) against stock",
    )
    args = parser.parse_args()
    path, prompts = _prompts(args.model)
    sampling = {
        "temperature": 0.0,
        "max_tokens": args.tokens,
        "ignore_eos": True,
        "logprobs": 5,
    }
    engine = {
        "dtype": "bfloat16",
        "disable_log_stats": False,
        "max_model_len": 512,
        "seed": 0,
        "enforce_eager": True,
    }
    base = generate_in_subprocess(
        path, prompts, sampling, {**engine, "max_num_seqs": 8}, env=STOCK_ENV
    )
    # Stock again with another batch: reversed, three at a time; one at a
    # time. The floor is the worst of the two against the first.
    runs = {
        "reversed_3": (prompts[::-1], {"max_num_seqs": 3}, STOCK_ENV),
        "alone": (prompts, {"max_num_seqs": 1}, STOCK_ENV),
    }
    if args.ours:
        runs["ours_async"] = (prompts, {"max_num_seqs": 8}, {})
        runs["ours_async_ngram"] = (
            prompts,
            {"max_num_seqs": 8, "speculative_config": {"method": "ngram_gpu", **NGRAM}},
            {},
        )
    report: dict[str, Any] = {"model": args.model, "tokens": args.tokens}
    for name, (batch, extra, env) in runs.items():
        records = generate_in_subprocess(
            path, batch, sampling, {**engine, **extra}, env=env
        )
        if batch is not prompts:
            records = records[::-1]
        report[name] = compare(records, base)
    stock = [report[name] for name in ("reversed_3", "alone")]
    report["floor"] = max(r["max_logprob_diff"] for r in stock)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
