"""The device backends the runner tests run on."""

import pytest


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
