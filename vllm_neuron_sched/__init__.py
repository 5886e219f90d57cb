"""Asynchronous scheduling for static-shape accelerators, as a vLLM plugin."""

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM platform-plugin entry point: the platform class path, or None."""
    from vllm_neuron_sched import envs

    if envs.VLLM_NEURON_SCHED_DISABLE:
        return None
    return "vllm_neuron_sched.platform.NeuronSchedPlatform"
