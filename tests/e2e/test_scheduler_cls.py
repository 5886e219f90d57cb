"""``--scheduler-cls`` with our scheduler on vLLM's own CPU worker (sync).

The oracle is stock vLLM CPU (our platform disabled) on the same checkpoint:
greedy float32 tokens must match token for token, although our scheduler never
mixes prefill and decode and so forms different batches.
"""

import pytest

from vllm_neuron_sched.testing import workloads
from vllm_neuron_sched.testing.oracle import start_in_subprocess

pytestmark = pytest.mark.slow


def test_scheduler_cls_matches_stock_vllm(checkpoint_dir: str) -> None:
    prompts = workloads.mixed_prompts()
    sampling = workloads.mixed_greedy()  # test_generate.py's stock run serves too
    ours_engine = {
        **workloads.SMALL_ENGINE,
        "scheduler_cls": "vllm_neuron_sched.core.scheduler.ChunkedPrefillScheduler",
        "worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker",
        "async_scheduling": False,
    }
    # Both children at once: each is mostly one core's work.
    stock_run = start_in_subprocess(
        checkpoint_dir,
        prompts,
        sampling,
        workloads.SMALL_ENGINE,
        env=workloads.STOCK_ENV,
    )
    ours_run = start_in_subprocess(checkpoint_dir, prompts, sampling, ours_engine)
    stock, ours = stock_run.result(), ours_run.result()
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    assert [len(r["token_ids"]) for r in ours] == workloads.MIXED_BUDGETS
