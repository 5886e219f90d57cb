"""Device runtime: the contract of an accelerator without streams (AWS Neuron
async mode), reproduced on CPU. See docs/design.md, section 2."""

from vllm_neuron_sched.runtime.backends import (
    InlineDevice,
    ThreadDevice,
    make_device,
)
from vllm_neuron_sched.runtime.device import Device
from vllm_neuron_sched.runtime.future import (
    DeviceExecutionError,
    DeviceFuture,
    DeviceShutdownError,
    DeviceStateError,
)
from vllm_neuron_sched.runtime.materializer import Materializer

__all__ = [
    "Device",
    "DeviceExecutionError",
    "DeviceFuture",
    "DeviceShutdownError",
    "DeviceStateError",
    "InlineDevice",
    "Materializer",
    "ThreadDevice",
    "make_device",
]
