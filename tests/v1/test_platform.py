"""Platform checks that need no engine: which workers share this node's
cores, and how many devices a node has."""

import pytest
from vllm.config import ParallelConfig

from vllm_neuron_sched.platform import (
    NeuronSchedPlatform,
    check_thread_binding,
    workers_on_this_node,
)


@pytest.mark.parametrize(
    ("parallel", "expected"),
    [
        ({"tensor_parallel_size": 4}, 4),
        # Two nodes of TP=4: two ranks on each.
        (
            {
                "tensor_parallel_size": 4,
                "nnodes": 2,
                "node_rank": 1,
                "master_addr": "127.0.0.1",
            },
            2,
        ),
        # Two replicas of TP=2 on this node.
        (
            {
                "tensor_parallel_size": 2,
                "data_parallel_size": 2,
                "data_parallel_size_local": 2,
            },
            4,
        ),
    ],
    ids=["tp4", "tp4_two_nodes", "dp2_tp2"],
)
def test_workers_on_this_node(parallel: dict, expected: int) -> None:
    assert workers_on_this_node(ParallelConfig(**parallel)) == expected


def test_automatic_binding_refused_with_the_variable_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm import envs as vllm_envs
    from vllm.utils import cpu_resource_utils

    monkeypatch.setattr(vllm_envs, "VLLM_CPU_OMP_THREADS_BIND", "auto", raising=False)
    monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: [0])
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    check_thread_binding(1)  # one worker per NUMA node: vLLM binds it
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND="):
        check_thread_binding(2)


def test_a_node_has_a_device_per_worker() -> None:
    """vLLM groups ranks into nodes by ``rank // device_count()``."""
    before = NeuronSchedPlatform.device_count()
    try:
        NeuronSchedPlatform.set_workers_per_node(1)
        assert NeuronSchedPlatform.device_count() == 1
        NeuronSchedPlatform.set_workers_per_node(2)
        assert NeuronSchedPlatform.device_count() == 2
    finally:
        NeuronSchedPlatform.set_workers_per_node(before)
