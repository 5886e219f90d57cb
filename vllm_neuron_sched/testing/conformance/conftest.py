"""The contract suite's fixture (``tests/v1/worker/conftest.py`` reuses it)."""

from collections.abc import Callable, Iterator

import pytest

from vllm_neuron_sched.runtime import Device, make_device


@pytest.fixture
def new_device() -> Iterator[Callable[..., Device]]:
    """Builds devices and shuts them all down after the test."""
    devices: list[Device] = []

    def build(kind: str, sim_device_ms: float = 0.0, label: str = "dev") -> Device:
        device = make_device(kind, sim_device_ms, label)
        devices.append(device)
        return device

    yield build
    for device in devices:
        device.shutdown()
