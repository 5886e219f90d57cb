"""The device runtime contract (``vllm_neuron_sched/testing/conformance``, the
suite a port runs on its hardware), here on every kind this environment has."""

from vllm_neuron_sched.testing.conformance.test_device_contract import *  # noqa: F403
