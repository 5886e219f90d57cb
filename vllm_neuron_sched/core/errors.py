"""Finish requests with an error, and keep serving the others.

Two kinds of request end here:

- one that can never fit a static shape: the platform refuses it at the API
  boundary (a 400); this is the engine-side net for requests that reach
  ``EngineCore`` directly. Raising inside the engine would take it down, and
  leaving it queued would stall the queue;
- one whose step failed on the device: the runner reports the step's
  requests in a ``FailedStepOutput``. The blocks that step was to fill hold
  whatever was there before, so they leave the prefix cache (vLLM registered
  them when it scheduled the step), whether their request still runs or was
  aborted meanwhile, and a running request that shares one of them (a
  prefix hit on them) fails with the step's requests.

Either way the request finishes with ``FINISHED_ERROR`` and its client gets
that on this step's output. A worker under a scheduler without this mixin
cannot fail requests one by one: it stops the engine with the device error
instead (``finishes_failed_requests``).
"""

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from vllm_neuron_sched.unsupported import STOCK, request_error

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_neuron_sched.core.limits import RequestLimits

logger = init_logger(__name__)


@dataclass
class FailedStepOutput(ModelRunnerOutput):
    """A step's output when one of its device executions failed: no tokens."""

    # req_id -> the device error (the worker's log has its traceback).
    failed_req_ids: dict[str, str] = field(default_factory=dict)


class ErrorFinishMixin:
    limits: "RequestLimits"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Finished with an error since the last output, to tell their clients.
        self._errored: list[Request] = []
        # id(a scheduled step's output) -> the full KV blocks the step fills,
        # which vLLM registered in the prefix cache when it scheduled it;
        # dropped when its output is read.
        self._filled_blocks: dict[int, set[int]] = {}

    def schedule(self, *args, **kwargs) -> "SchedulerOutput":
        output = super().schedule(*args, **kwargs)
        if self.cache_config.enable_prefix_caching and output.num_scheduled_tokens:
            self._filled_blocks[id(output)] = self._blocks_filled_by(output)
        return output

    def add_request(self, request: "Request") -> None:
        super().add_request(request)
        error = self.limits.check(request.num_prompt_tokens, request.max_tokens)
        if error is None and request.sampling_params is not None:
            error = self.limits.check_sampling(request.sampling_params)
            error = error or request_error(request.sampling_params)
        if error is None and request.resumable:
            error = (
                "streaming-input sessions (a prompt from an async generator) are "
                f"not supported by vllm_neuron_sched: send whole prompts, or use "
                f"{STOCK}"
            )
        if error is not None:
            logger.warning("Rejecting request %s: %s", request.request_id, error)
            self._errored.extend(
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            )

    def update_from_output(
        self,
        scheduler_output: "SchedulerOutput",
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        filled = self._filled_blocks.pop(id(scheduler_output), set())
        if isinstance(model_runner_output, FailedStepOutput):
            # Before vLLM reads the output: finished requests get no tokens.
            self._finish_failed(model_runner_output.failed_req_ids, filled)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self._errored:
            eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                )
            )
        self._errored.clear()
        return outputs

    def _finish_failed(self, failed: dict[str, str], unwritten: set[int]) -> None:
        """``unwritten``: the full blocks the failed step was to fill (of
        requests aborted since too, which no longer hold them)."""
        req_ids = failed.keys() & self.requests.keys()
        held = set().union(*map(self._block_ids, req_ids))
        sharing = {
            r.request_id
            for r in self.running
            if r.request_id not in req_ids
            and not unwritten.isdisjoint(self._block_ids(r.request_id))
        }
        if held | unwritten:
            self.kv_cache_manager.evict_blocks(held | unwritten)
        logger.error(
            "Finishing requests %s with an error: their step failed on the "
            "device (%s)%s",
            sorted(req_ids),
            next(iter(failed.values()), ""),
            f"; {sorted(sharing)} shared their unwritten KV blocks" if sharing else "",
        )
        self._errored.extend(
            self.finish_requests(req_ids | sharing, RequestStatus.FINISHED_ERROR)
        )

    def _block_ids(self, req_id: str) -> set[int]:
        """Every KV block the request holds, in every cache group."""
        groups = self.kv_cache_manager.get_block_ids(req_id)
        return set(itertools.chain.from_iterable(groups))

    def _blocks_filled_by(self, output: "SchedulerOutput") -> set[int]:
        """The blocks, in every cache group, that the step's tokens fill up:
        those vLLM registered in the prefix cache for it."""
        starts = _positions_before(output)
        block_sizes = [
            group.kv_cache_spec.block_size
            for group in self.kv_cache_config.kv_cache_groups
        ]
        filled: set[int] = set()
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            start = starts[req_id]
            if all((start + num_tokens) // bs == start // bs for bs in block_sizes):
                continue  # fills no block (most decode steps)
            groups = self.kv_cache_manager.get_block_ids(req_id)
            for block_ids, bs in zip(groups, block_sizes):
                filled.update(block_ids[start // bs : (start + num_tokens) // bs])
        return filled


def _positions_before(scheduler_output: "SchedulerOutput") -> dict[str, int]:
    """req_id -> its computed tokens when the step was scheduled: the first
    position the step writes."""
    starts = {
        new.req_id: new.num_computed_tokens
        for new in scheduler_output.scheduled_new_reqs
    }
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


def finishes_failed_requests(scheduler_cls: "str | type | None") -> bool:
    """Whether the engine's scheduler finishes the requests of a failed step
    (ours do); vLLM's own and unknown ones would wait for their tokens."""
    if scheduler_cls is None:
        return False
    if isinstance(scheduler_cls, str):
        scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
    return isinstance(scheduler_cls, type) and issubclass(
        scheduler_cls, ErrorFinishMixin
    )
