"""``--scheduler-cls`` with our scheduler on vLLM's own CPU worker (sync).

The oracle is stock vLLM CPU (our platform disabled) on the same checkpoint:
greedy float32 tokens must match token for token, although our scheduler never
mixes prefill and decode and so forms different batches.
"""

import pytest

from vllm_neuron_sched.testing.oracle import generate_in_subprocess
from vllm_neuron_sched.testing.workloads import (
    SMALL_ENGINE,
    STOCK_ENV,
    greedy,
    token_prompts,
)

pytestmark = pytest.mark.slow

# Prompt lengths (in tokens) cross the 32-token chunk size; max_tokens differ so
# requests finish at different steps and later ones join a running batch.
PROMPT_LENGTHS = [5, 33, 70, 12, 47]
MAX_TOKENS = [12, 20, 8, 16, 10]


def test_scheduler_cls_matches_stock_vllm(checkpoint_dir: str) -> None:
    prompts, sampling = token_prompts(PROMPT_LENGTHS), greedy(MAX_TOKENS)
    stock = generate_in_subprocess(
        checkpoint_dir, prompts, sampling, SMALL_ENGINE, env=STOCK_ENV
    )
    ours = generate_in_subprocess(
        checkpoint_dir,
        prompts,
        sampling,
        {
            **SMALL_ENGINE,
            "scheduler_cls": "vllm_neuron_sched.core.scheduler.ChunkedPrefillScheduler",
            "worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker",
            "async_scheduling": False,
        },
    )
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    assert [len(r["token_ids"]) for r in ours] == MAX_TOKENS
