"""Pooling with static batch shapes.

The device holds a few compiled pooling graphs (prompt length x batch size).
A new batch starts only when nothing runs, and takes the longest run of waiting
requests, in arrival order, that fits one shape and the token budget; the rest
wait in order. Pooling is synchronous only: a pooling step produces no token
for the scheduler to run ahead on.
"""

from typing import TYPE_CHECKING

from vllm_neuron_sched.core.errors import ErrorFinishMixin
from vllm_neuron_sched.core.limits import RequestLimits
from vllm_neuron_sched.core.step_view import restricted_view

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class PoolingMixin(ErrorFinishMixin):
    """Policy over vLLM's ``Scheduler`` (listed after it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = RequestLimits.from_config(self.vllm_config)

    def schedule(self, *args, **kwargs) -> "SchedulerOutput":
        batch = [] if self.running else self.next_batch()
        with restricted_view(self, self.running, batch):
            return super().schedule(*args, **kwargs)

    def next_batch(self) -> list["Request"]:
        """The longest prefix of the waiting queue that fits one static shape."""
        batch: list[Request] = []
        longest = num_tokens = 0
        for request in self.waiting:
            longest = max(longest, request.num_tokens)
            num_tokens += request.num_tokens
            if (
                len(batch) + 1 > self.max_num_running_reqs
                or num_tokens > self.max_num_scheduled_tokens
                or not self.limits.fits_pooling_shape(longest, len(batch) + 1)
            ):
                break
            batch.append(request)
        return batch
