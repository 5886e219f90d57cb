"""Shared fixtures: one tiny checkpoint per test session, offline engines."""

import os

import pytest

# Engines in tests never reach a hub, keep the KV cache small, and spawn.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded default checkpoint (2 layers, hidden 256, head_dim 64)."""
    from vllm_neuron_sched.testing.checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama"))
