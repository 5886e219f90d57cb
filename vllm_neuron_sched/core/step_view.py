"""Show vLLM's scheduler only the requests a step may contain.

The device cannot mix prefill and decode, and pooling runs whole static
batches, so our policies decide *which* requests a step holds and then let
vLLM's ``Scheduler.schedule()`` do the rest (token accounting, KV allocation,
preemption, the output dataclasses) over just those requests.
"""

import enum
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm.v1.core.sched.request_queue import create_request_queue

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request


class BatchShape(enum.Enum):
    """What a step's batch holds: a fact about the batch, whoever scheduled
    it (``chunked_prefill.StepPlanKind`` is our scheduler's decision)."""

    DECODE = "decode"  # every row decodes one token
    PREFILL = "prefill"  # prompt chunks only
    MIXED = "mixed"  # both: only a scheduler that mixes them (vLLM's) makes these
    IDLE = "idle"  # nothing scheduled

    @classmethod
    def of(cls, is_prefill: Iterable[bool]) -> "BatchShape":
        """From each row's "runs prompt tokens" flag."""
        flags = set(is_prefill)
        if not flags:
            return cls.IDLE
        if len(flags) == 2:
            return cls.MIXED
        return cls.PREFILL if True in flags else cls.DECODE


@contextmanager
def restricted_view(
    scheduler: "Scheduler",
    running: Sequence["Request"],
    waiting: Sequence["Request"],
) -> Iterator[None]:
    """Within the block, ``scheduler.running`` and both waiting queues hold
    only the given requests; afterwards, the hidden ones are merged back in
    their order.

    vLLM 0.32 keeps waiting requests that hold KV blocks in a second queue,
    ``kv_holding_waiting``, and drains it before ``waiting``: it is hidden
    too, or a decode step could admit one of them. Requests vLLM admits move
    to ``running`` as usual; those it preempts land at the front of the real
    waiting queues.
    """
    all_running = scheduler.running
    all_queues = {
        "waiting": scheduler.waiting,
        "kv_holding_waiting": scheduler.kv_holding_waiting,
    }
    views = {name: create_request_queue(scheduler.policy) for name in all_queues}
    for request in waiting:
        holding = any(r is request for r in all_queues["kv_holding_waiting"])
        name = "kv_holding_waiting" if holding else "waiting"
        all_queues[name].remove_request(request)
        views[name].add_request(request)
    visible_running = set(running)
    scheduler.running = list(running)
    for name, view in views.items():
        setattr(scheduler, name, view)
    try:
        yield
    finally:
        still_running = scheduler.running
        scheduler.running = [
            r for r in all_running if r not in visible_running
        ] + still_running
        for name, queue in all_queues.items():
            left = list(getattr(scheduler, name))
            setattr(scheduler, name, queue)
            if left:
                queue.prepend_requests(reversed(left))
