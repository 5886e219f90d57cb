"""Finish requests that can never fit a static shape, with an error output.

The platform refuses them at the API boundary (a 400); this is the engine-side
net for requests that reach ``EngineCore`` directly. Raising inside the engine
would take it down, and leaving them queued would stall the queue, so they are
finished with ``FINISHED_ERROR`` and the client gets that on the next step.
"""

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from vllm_neuron_sched.core.limits import RequestLimits

logger = init_logger(__name__)


class RejectionMixin:
    limits: "RequestLimits"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rejected: list[Request] = []

    def add_request(self, request: "Request") -> None:
        super().add_request(request)
        error = self.limits.check(request.num_prompt_tokens, request.max_tokens)
        if error is not None:
            logger.warning("Rejecting request %s: %s", request.request_id, error)
            self._rejected.extend(
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            )

    def update_from_output(
        self,
        scheduler_output: "SchedulerOutput",
        model_runner_output: "ModelRunnerOutput",
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self._rejected:
            eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                )
            )
        self._rejected.clear()
        return outputs
