"""The concrete schedulers: policy mixin first, vLLM base second.

Pick one with ``--scheduler-cls vllm_neuron_sched.core.scheduler.<Name>``; the
platform picks from ``--async-scheduling`` when none is given.
"""

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_neuron_sched.core.chunked_prefill import ChunkedPrefillMixin
from vllm_neuron_sched.core.pooling import PoolingMixin


class ChunkedPrefillScheduler(ChunkedPrefillMixin, Scheduler):
    pass


class AsyncChunkedPrefillScheduler(ChunkedPrefillMixin, AsyncScheduler):
    pass


class PoolingScheduler(PoolingMixin, Scheduler):
    pass


__all__ = [
    "AsyncChunkedPrefillScheduler",
    "ChunkedPrefillScheduler",
    "PoolingScheduler",
]
