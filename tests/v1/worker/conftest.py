"""The device backends the runner tests run on."""

import pytest

# The device contract suite's fixture (test_runtime.py, test_device_contract.py).
from vllm_neuron_sched.testing.conformance.conftest import new_device  # noqa: F401


@pytest.fixture(params=["default", "thread"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``default``: what a CPU user gets (no device variables set);
    ``thread``: the threaded device, whose executions outlive ``enqueue``."""
    if request.param == "thread":
        monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    else:
        monkeypatch.delenv("VLLM_NEURON_SCHED_DEVICE", raising=False)
        monkeypatch.delenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", raising=False)
    return request.param
