"""Observers of the async flow that the runner always keeps: the TP
consistency digest and the periodic counter log line."""

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_neuron_sched.worker.async_flow import FlowObserver
from vllm_neuron_sched.worker.token_table import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_neuron_sched.worker.async_flow import AsyncFlow

logger = init_logger(__name__)

_MOD = 2**256


class RankDigest(FlowObserver):
    """A digest of the finished requests' token histories, equal on every TP
    rank when none drifts (``get_rank_state``).

    A finished request is digested once its history holds no placeholder
    (the steps that sampled for it have retired): at the next requests that
    finish, or when the digest is asked for (after the flow drained). Ranks
    may retire the newest step at different moments, so per-request digests
    are summed, which does not depend on the order requests complete in.
    """

    def __init__(self) -> None:
        self._finished_sum = 0
        self._pending: list[tuple[str, list[int]]] = []

    def requests_finished(self, finished: list[tuple[str, list[int]]]) -> None:
        self._pending.extend(finished)
        self._digest_completed()

    def finished_hexdigest(self) -> str:
        self._digest_completed()
        return f"{self._finished_sum:064x}"

    def _digest_completed(self) -> None:
        pending = []
        for req_id, history in self._pending:
            if PLACEHOLDER_TOKEN_ID in history:
                pending.append((req_id, history))
                continue
            value = hashlib.sha256(f"{req_id}:{history}".encode()).digest()
            self._finished_sum = (self._finished_sum + int.from_bytes(value)) % _MOD
        self._pending = pending


class StatsLog(FlowObserver):
    """Logs the flow's counters every ``interval_s`` seconds
    (VLLM_NEURON_SCHED_STATS_INTERVAL_S, read once)."""

    def __init__(
        self, flow: "AsyncFlow", clock: Callable[[], float], interval_s: float
    ) -> None:
        self._flow = flow
        self._clock = clock
        self._interval_s = interval_s
        self._logged_at = clock()

    def step_began(self, step: int, scheduler_output: "SchedulerOutput") -> None:
        now = self._clock()
        if now - self._logged_at < self._interval_s:
            return
        self._logged_at = now
        stats: dict[str, Any] = self._flow.stats()
        logger.info(
            "Async scheduling: %d async steps, %d sync fallback steps, "
            "%d prefill steps, %d dead tokens",
            stats["async_steps"],
            stats["sync_fallback_steps"],
            stats["prefill_steps"],
            stats["dead_tokens"],
        )
