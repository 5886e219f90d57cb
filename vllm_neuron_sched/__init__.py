"""Asynchronous scheduling for static-shape accelerators, as a vLLM plugin."""

import logging

__version__ = "0.1.0"


def _log_through_vllm() -> None:
    """vLLM configures only the ``vllm`` logger namespace; hang ours under it so
    ``init_logger(__name__)`` lines use vLLM's handlers, format and level."""
    logging.getLogger(__name__).parent = logging.getLogger("vllm")


def register() -> str | None:
    """vLLM platform-plugin entry point: the platform class path, or None."""
    from vllm_neuron_sched import envs

    if envs.VLLM_NEURON_SCHED_DISABLE:
        return None
    _log_through_vllm()
    return "vllm_neuron_sched.platform.NeuronSchedPlatform"
