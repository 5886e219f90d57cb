"""What a step's last device execution returns, typed, and the one place that
turns it into the engine's output on the host.

A step's last execution is its sampling (``Sampled``), its verification
(``Verified``), or, for a step that samples nothing, its forward (``None``).
Each result holds device tensors until the step's output is materialized:
then, and only then, the host reads them (``to_output``).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput

from vllm_neuron_sched.core.errors import FailedStepOutput
from vllm_neuron_sched.runtime import (
    DeviceExecutionError,
    DeviceFuture,
    DeviceStateError,
    Materializer,
)

logger = init_logger(__name__)


@dataclass
class DraftedOutput(ModelRunnerOutput):
    """A speculating step's output, with the drafts its sampling proposed for
    each row's next step (sync scheduling hands them to the scheduler)."""

    draft_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Drafts:
    """Each row's drafts for its next step."""

    tokens: torch.Tensor  # [rows, K] int32
    counts: torch.Tensor  # [rows] int64: how many of a row's K are drafts

    def per_row(self, is_sampled: Sequence[bool]) -> list[list[int]]:
        return [
            row[:count] if keep else []
            for row, count, keep in zip(
                self.tokens.tolist(), self.counts.tolist(), is_sampled
            )
        ]


@dataclass(frozen=True)
class VerifyForward:
    """A verify step's forward, for its verification (same step)."""

    logits: torch.Tensor  # [rows * (1 + K), vocab]: every real row's queries
    num_drafts: torch.Tensor  # [rows] int64: drafts each row verifies
    starts: torch.Tensor  # [rows] int64: history position of each row's input
    drafts: torch.Tensor  # [rows, K] int32: the drafts it verifies


@dataclass(frozen=True)
class Sampled:
    """A sampling step's tokens: one per row (a row that does not sample
    wrote the spare slot, and its token is dropped)."""

    tokens: torch.Tensor  # [rows] int32
    logprobs: LogprobsTensors | None
    drafts: Drafts | None = None  # speculating: each new request's first

    def token_ids(self, is_sampled: Sequence[bool]) -> list[list[int]]:
        return [
            [token] if keep else []
            for token, keep in zip(self.tokens.tolist(), is_sampled)
        ]


@dataclass(frozen=True)
class Verified:
    """A verify step's tokens: each row's accepted run, its bonus or
    replacement token last."""

    tokens: torch.Tensor  # [rows, 1 + K] int32, REJECTED past the run
    counts: torch.Tensor  # [rows] int64: the run's length
    logprobs: LogprobsTensors | None
    drafts: Drafts

    def token_ids(self, is_sampled: Sequence[bool]) -> list[list[int]]:
        return [
            row[:count]
            for row, count in zip(self.tokens.tolist(), self.counts.tolist())
        ]


def to_output(
    result: Sampled | Verified | None,
    req_ids: list[str],
    is_sampled: list[bool],
    prompt_logprobs: dict[str, LogprobsTensors],
) -> ModelRunnerOutput:
    """The host's copy of a step's result, as the engine takes it."""
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    if result is None:  # prompt chunks that are not their last
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=index,
            sampled_token_ids=[[] for _ in req_ids],
        )
    logprobs = result.logprobs
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=index,
        sampled_token_ids=result.token_ids(is_sampled),
        logprobs=None if logprobs is None else logprobs.tolists(),
        prompt_logprobs_dict=prompt_logprobs,
    )
    if result.drafts is None:
        return output
    return DraftedOutput(
        **vars(output), draft_token_ids=result.drafts.per_row(is_sampled)
    )


def make_output_materializer(
    result: DeviceFuture,
    req_ids: Sequence[str],
    is_sampled: Sequence[bool],
    prompt_logprobs: dict[str, LogprobsTensors],
    fails_requests_alone: bool,
) -> Materializer[ModelRunnerOutput]:
    """The device result as host lists, built at most once by whichever thread
    asks first. It reads only its own captures, never the input batch.

    If the execution failed, the step's requests finish with an error
    (``FailedStepOutput``; with ``fails_requests_alone``, else the error
    stops the engine); a failed state update (``DeviceStateError``) always
    stops the engine: nothing computed after it can be trusted.
    """
    req_ids = list(req_ids)
    is_sampled = list(is_sampled)

    def materialize() -> ModelRunnerOutput:
        try:
            values = result.result()
        except DeviceStateError:
            raise
        except DeviceExecutionError as exc:
            if not fails_requests_alone:
                raise
            logger.error(
                "A device execution of a step failed; its requests %s finish "
                "with an error, the others go on",
                req_ids,
                exc_info=exc,
            )
            return FailedStepOutput(
                req_ids=req_ids,
                req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
                sampled_token_ids=[[] for _ in req_ids],
                failed_req_ids=dict.fromkeys(req_ids, _root_cause(exc)),
            )
        return to_output(values, req_ids, is_sampled, prompt_logprobs)

    return Materializer(materialize)


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return repr(error)
