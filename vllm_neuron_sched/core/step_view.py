"""Show vLLM's scheduler only the requests a step may contain.

The device cannot mix prefill and decode, and pooling runs whole static
batches, so our policies decide *which* requests a step holds and then let
vLLM's ``Scheduler.schedule()`` do the rest (token accounting, KV allocation,
preemption, the output dataclasses) over just those requests.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm.v1.core.sched.request_queue import create_request_queue

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request


@contextmanager
def restricted_view(
    scheduler: "Scheduler",
    running: Sequence["Request"],
    waiting: Sequence["Request"],
) -> Iterator[None]:
    """Within the block, ``scheduler.running``/``waiting`` hold only the given
    requests; afterwards, the hidden ones are merged back in their order.

    Requests vLLM admits move from ``waiting`` to ``running`` as usual; those it
    preempts land at the front of the real waiting queue.
    """
    all_running = scheduler.running
    all_waiting = scheduler.waiting
    visible_running = set(running)
    view_waiting = create_request_queue(scheduler.policy)
    for request in waiting:
        all_waiting.remove_request(request)
        view_waiting.add_request(request)
    scheduler.running = list(running)
    scheduler.waiting = view_waiting
    try:
        yield
    finally:
        still_running = scheduler.running
        left_waiting = list(scheduler.waiting)
        scheduler.running = [
            r for r in all_running if r not in visible_running
        ] + still_running
        scheduler.waiting = all_waiting
        if left_waiting:
            all_waiting.prepend_requests(reversed(left_waiting))
