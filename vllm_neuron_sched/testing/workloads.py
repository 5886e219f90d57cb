"""Prompts, sampling parameters and engine settings the tests share: small,
deterministic, crossing the chunk size, so requests finish at different steps
and join a running batch."""

from typing import Any

# An engine that starts fast and exercises chunking: prompts longer than 32
# tokens take several prefill steps, and 4 sequence slots make later
# requests wait and join. Everything else is vLLM's default (the prefix cache
# is on), as a user gets it.
SMALL_ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "seed": 0,
    # Our default KV block, given to stock too (its own is larger), so
    # prefix-cache hits, which are whole blocks, land at the same positions.
    "block_size": 64,
    # Engine start is the slow part of these tests; eager skips torch.compile.
    "enforce_eager": True,
}
STOCK_ENV = {"VLLM_NEURON_SCHED_DISABLE": "1"}  # stock vLLM CPU in a child
# bfloat16: how far stock's logprobs move from themselves when only the batch
# changes, on the test models (``python -m benchmarks.bf16_floor``; docs/
# design.md section 12), with a bf16 step of margin.
BF16_LOGPROB_FLOOR = 0.032
# N-gram speculation, K = 3.
NGRAM = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# The compatibility matrix's columns (README.md): engine keywords per mode.
# "ngram_gpu" is vLLM's name for the proposer on the device, which keeps
# async scheduling on.
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    "async_ngram": {
        "async_scheduling": True,
        "speculative_config": {"method": "ngram_gpu", **NGRAM},
    },
}

# The OpenAI-server tests (TP=4, soak, two nodes, data parallel): one engine
# shape, so one oracle run serves every module that compares with it.
SERVER_ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "seed": 0,
    "enforce_eager": True,
}
# The soaks' servers (``testing/soak.py``): 16 clients at a time all run.
SOAK_ENGINE: dict[str, Any] = {**SERVER_ENGINE, "max_num_seqs": 16}
# The KV block of the test engines (our default).
BLOCK = 64
# Lengths cross a KV block and differ: requests end at different steps. The
# last shares the 70-token prompt's first block and ends one token past it.
SERVER_PROMPT_LENGTHS = [5, 33, 70, 12, 65]
SERVER_MAX_TOKENS = 16
# One KV block and two, plus one: a repeat of such a prompt hits the prefix
# cache for all but its last token, which vLLM pads with placeholder drafts
# when the engine speculates.
PREFIX_HIT_LENGTHS = [BLOCK + 1, 2 * BLOCK + 1]
# Prompt lengths across the 32-token chunk size and budgets that differ:
# seven requests over four sequence slots finish at different steps and
# later ones join a running batch. The last two share the 70-token prompt's
# first block (a prefix-cache hit once it is registered): one ends a token
# past it, one a block.
MIXED_LENGTHS = [5, 33, 70, 12, 47, *PREFIX_HIT_LENGTHS]
MIXED_BUDGETS = [12, 20, 8, 16, 10, 9, 14]


def token_prompts(
    lengths: list[int], stride: int = 7, salt: int = 13
) -> list[list[int]]:
    """One token-id prompt per length (ids 10..909: no special tokens)."""
    return [[(stride * i + salt * n) % 900 + 10 for i in range(n)] for n in lengths]


def sharing_prompts(lengths: list[int]) -> list[list[int]]:
    """``token_prompts``, where every prompt longer than a KV block after
    the first such one starts with that one's first block."""
    prompts = token_prompts(lengths)
    first = next(p for p in prompts if len(p) > BLOCK)
    for prompt in prompts:
        if len(prompt) > BLOCK:
            prompt[:BLOCK] = first[:BLOCK]
    return prompts


def mixed_prompts() -> list[list[int]]:
    """The prompts of ``MIXED_LENGTHS``, sharing a block."""
    return sharing_prompts(MIXED_LENGTHS)


def server_prompts() -> list[list[int]]:
    """The prompts of ``SERVER_PROMPT_LENGTHS``, sharing a block."""
    return sharing_prompts(SERVER_PROMPT_LENGTHS)


def mixed_greedy(num_logprobs: int = 3) -> list[dict[str, Any]]:
    """Greedy, ``MIXED_BUDGETS`` tokens, with logprobs (and on the second
    request, the longest, prompt logprobs and the three penalties): the
    stock oracle every mixed-workload test compares with, so one stock run
    serves them all."""
    params = greedy(MIXED_BUDGETS, logprobs=num_logprobs)
    params[1].update(
        prompt_logprobs=num_logprobs,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
    )
    return params


def greedy(max_tokens: list[int], **extra: Any) -> list[dict[str, Any]]:
    """Greedy ``SamplingParams`` keyword sets, one per budget, EOS ignored."""
    return [
        {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **extra}
        for n in max_tokens
    ]
