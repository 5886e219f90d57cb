"""On-device sampling and the output that carries its result back to the host.

The sampler runs on the device (vLLM's ``Sampler``: penalties, top-k/p, min-p,
seeds, logprobs). On a threaded device everything it reads is a snapshot taken
at enqueue, because the main thread builds the next step while this one
samples; an inline device samples at enqueue and reads the batch as it is.
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_neuron_sched.core.errors import FailedStepOutput
from vllm_neuron_sched.runtime import (
    DeviceExecutionError,
    DeviceFuture,
    DeviceStateError,
    Materializer,
)
from vllm_neuron_sched.worker.speculation import (
    Proposer,
    after_prompt_sampling,
    plan_grammar,
    verify_on_device,
)
from vllm_neuron_sched.worker.token_table import PLACEHOLDER_TOKEN_ID

logger = init_logger(__name__)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.runtime import Device
    from vllm_neuron_sched.worker.inputs import StepInputs
    from vllm_neuron_sched.worker.token_table import DeviceTokens


def snapshot_sampling_metadata(metadata: "SamplingMetadata") -> "SamplingMetadata":
    """A copy the device may read while the host mutates the input batch
    (threaded devices only: an inline device samples at enqueue).

    Tensors are cloned, token histories and generator maps copied. Logits
    processors that hold state are deep-copied, each live history mapped to
    its copy: they keep references to the request's output-token list
    (min_tokens, the per-request adapters), which the main thread appends the
    next placeholder to right after this step is enqueued; read live, they
    would see one token too many. vLLM's built-in processors with nothing to
    do (no request uses them) are left out, so all-greedy batches copy none.
    """

    def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.clone()

    histories = [list(ids) for ids in metadata.output_token_ids]
    memo = {
        id(live): copied for live, copied in zip(metadata.output_token_ids, histories)
    }
    processors = LogitsProcessors()
    for name in ("argmax_invariant", "non_argmax_invariant"):
        live = getattr(metadata.logitsprocs, name)
        kept = [p for p in live if not _is_idle(p)]
        setattr(processors, name, copy.deepcopy(kept, memo) if kept else [])
    return replace(
        metadata,
        temperature=clone(metadata.temperature),
        top_p=clone(metadata.top_p),
        top_k=clone(metadata.top_k),
        frequency_penalties=clone(metadata.frequency_penalties),
        presence_penalties=clone(metadata.presence_penalties),
        repetition_penalties=clone(metadata.repetition_penalties),
        allowed_token_ids_mask=clone(metadata.allowed_token_ids_mask),
        output_token_ids=histories,
        generators=dict(metadata.generators),
        bad_words_token_ids=dict(metadata.bad_words_token_ids),
        spec_token_ids=None,
        logitsprocs=processors,
    )


def _is_idle(processor: object) -> bool:
    """A built-in processor that no request in the batch uses: its apply() is
    the identity. Anything else (custom processors) counts as busy."""
    if isinstance(processor, MinPLogitsProcessor):
        return not processor.min_p_count
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    return False


@dataclass
class DraftedOutput(ModelRunnerOutput):
    """A speculating step's output, with the drafts its sampling proposed for
    each row's next step (sync scheduling hands them to the scheduler)."""

    draft_token_ids: list[list[int]] = field(default_factory=list)


def history_repairs(
    histories: Sequence[list[int]], slots: np.ndarray
) -> list[tuple[int, int]]:
    """(row, token slot) of each history ending in a placeholder: penalties
    and bad words need that token, which is still on the device."""
    return [
        (row, int(slots[row]))
        for row, history in enumerate(histories)
        if history and history[-1] == PLACEHOLDER_TOKEN_ID
    ]


def sample_on_device(
    sampler: "Sampler",
    tokens: "DeviceTokens",
    logits: torch.Tensor,
    metadata: "SamplingMetadata",
    write_slots: torch.Tensor,
    discarded_rows: list[int],
    repairs: list[tuple[int, int]],
    grammar: "tuple[SchedulerOutput, GrammarOutput, list[str]] | None",
    speculation: "tuple[Proposer, torch.Tensor, dict[int, torch.Tensor]] | None" = None,
) -> dict[str, Any]:
    """Runs on the device thread. Samples, writes each sampling row's token
    into the device token table (``write_slots``; non-sampling rows point at
    the padding slot) and returns the tokens and their logprobs.
    ``speculation``: also into the histories (at each row's next position),
    and propose each row's first drafts (the proposer, the positions, the
    rows' block tables)."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    with torch.inference_mode():
        if grammar is not None:
            scheduler_output, grammar_output, req_ids = grammar
            rows = SimpleNamespace(req_ids=req_ids)
            apply_grammar_bitmask(scheduler_output, grammar_output, rows, logits)
        if repairs:
            # Histories end in the previous token, still a placeholder on the
            # host: take it from the table (copies: the lists may be live).
            histories = list(metadata.output_token_ids)
            latest = tokens.read(torch.tensor([slot for _, slot in repairs]))
            for (row, _), token in zip(repairs, latest.tolist()):
                histories[row] = [*histories[row][:-1], token]
            metadata = replace(metadata, output_token_ids=histories)
        # A prompt chunk that is not the last samples nothing: its seeded
        # generator must not advance, so seeds reproduce however it is chunked.
        kept_states = {
            row: metadata.generators[row].get_state()
            for row in discarded_rows
            if row in metadata.generators
        }
        output = sampler(logits=logits, sampling_metadata=metadata)
        sampled = output.sampled_token_ids[:, 0].to(torch.int32)
        for row, state in kept_states.items():
            metadata.generators[row].set_state(state)
        tokens.write(write_slots, sampled)
        result = {"sampled": sampled, "logprobs": output.logprobs_tensors}
        if speculation is not None:
            proposer, positions, tables = speculation
            result |= after_prompt_sampling(
                proposer, tokens, write_slots, positions, sampled, tables
            )
    return result


def prompt_logprobs_on_device(
    model: Any,
    sampler: "Sampler",
    logprobs_mode: str,
    hidden_states: torch.Tensor,
    offset: int,
    chunk_start: int,
    target_ids: torch.Tensor,
    num_logprobs: int,
    buffer: LogprobsTensors,
) -> None:
    """Runs on the device thread, in the forward: one prompt chunk's logprobs
    into the request's buffer (returned with its last chunk's output)."""
    num_logits = target_ids.shape[0]
    logits = model.compute_logits(hidden_states[offset : offset + num_logits])
    if logprobs_mode in ("raw_logits", "processed_logits"):
        scores = logits.to(torch.float32)
    else:
        scores = sampler.compute_logprobs(logits)
    token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(
        scores, num_logprobs, target_ids
    )
    chunk = slice(chunk_start, chunk_start + num_logits)
    buffer.logprob_token_ids[chunk].copy_(token_ids)
    buffer.logprobs[chunk].copy_(logprobs)
    buffer.selected_token_ranks[chunk].copy_(ranks)


def enqueue_sampling(
    device: "Device",
    sampler: "Sampler",
    tokens: "DeviceTokens",
    logits: DeviceFuture,
    inputs: "StepInputs",
    metadata: "SamplingMetadata",
    grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
    prompt_logprobs: dict[str, LogprobsTensors],
    fails_requests_alone: bool,
    proposer: Proposer | None = None,
) -> tuple[DeviceFuture, Materializer[ModelRunnerOutput]]:
    """The step's last execution and its output: sampling, or for a step that
    samples nothing its forward (whose failure must reach the requests too).
    ``metadata``: the input batch's, read now or (threaded device) snapshot.
    A verify step (``inputs.verify``) runs the rejection sampler instead."""
    result = logits
    if inputs.verify is not None:
        assert proposer is not None
        if not device.runs_at_enqueue:
            metadata = snapshot_sampling_metadata(metadata)
        result = device.enqueue(
            verify_on_device,
            proposer,
            sampler,
            tokens,
            logits,
            metadata,
            inputs.verify,
            None
            if grammar is None
            else plan_grammar(
                grammar[1],
                list(inputs.req_ids),
                grammar[0].scheduled_spec_decode_tokens,
                inputs.verify.width,
            ),
        )
    elif inputs.has_samples:
        repairs = history_repairs(metadata.output_token_ids, inputs.token_slots)
        if not device.runs_at_enqueue:
            metadata = snapshot_sampling_metadata(metadata)
        result = device.enqueue(
            sample_on_device,
            sampler,
            tokens,
            logits,
            metadata,
            inputs.sample_slots,
            np.flatnonzero(~inputs.is_sampled).tolist(),
            repairs,
            None if grammar is None else _own_masks(*grammar, inputs.req_ids),
            None
            if proposer is None
            else (proposer, inputs.next_positions, inputs.block_tables()),
        )
    output = make_output_materializer(
        result, inputs.req_ids, inputs.is_sampled, prompt_logprobs, fails_requests_alone
    )
    return result, output


def _own_masks(
    scheduler_output: "SchedulerOutput",
    grammar_output: "GrammarOutput",
    req_ids: Sequence[str],
) -> "tuple[SchedulerOutput, GrammarOutput, list[str]]":
    """The grammar's masks as this step's own copy: the scheduler refills
    its mask buffer for the next step while this one may still sample."""
    own = replace(grammar_output, grammar_bitmask=grammar_output.grammar_bitmask.copy())
    return scheduler_output, own, list(req_ids)


def make_output_materializer(
    result: DeviceFuture,
    req_ids: Sequence[str],
    is_sampled: Sequence[bool],
    prompt_logprobs: dict[str, LogprobsTensors],
    fails_requests_alone: bool,
) -> Materializer[ModelRunnerOutput]:
    """The device result as host lists, built at most once by whichever thread
    asks first. It reads only its own captures, never the input batch.

    ``result`` is the step's sampling, or its forward when no row samples
    (its value is then None). If it failed, the step's requests finish with
    an error (``FailedStepOutput``; with ``fails_requests_alone``, else the
    error stops the engine); a failed state update (``DeviceStateError``)
    always stops the engine: nothing computed after it can be trusted.
    """
    req_ids = list(req_ids)
    is_sampled = list(is_sampled)
    index = {req_id: i for i, req_id in enumerate(req_ids)}

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
                req_id_to_index=index,
                sampled_token_ids=[[] for _ in req_ids],
                failed_req_ids=dict.fromkeys(req_ids, _root_cause(exc)),
            )
        if values is None:  # prompt chunks that are not their last
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index=index,
                sampled_token_ids=[[] for _ in req_ids],
            )
        if "tokens" in values:  # a verify step: each row's accepted run
            counts = values["counts"].tolist()
            rows = values["tokens"].tolist()
            sampled = [row[:count] for row, count in zip(rows, counts)]
            logprobs = values["logprobs"]
        else:
            tokens = values["sampled"].tolist()
            sampled = [
                [token] if keep else [] for token, keep in zip(tokens, is_sampled)
            ]
            logprobs = values["logprobs"]
        if "drafts" not in values:
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index=index,
                sampled_token_ids=sampled,
                logprobs=None if logprobs is None else logprobs.tolists(),
                prompt_logprobs_dict=prompt_logprobs,
            )
        draft_counts = values["draft_counts"].tolist()
        drafts = [
            row[:count] if keep else []
            for row, count, keep in zip(
                values["drafts"].tolist(), draft_counts, is_sampled
            )
        ]
        return DraftedOutput(
            req_ids=req_ids,
            req_id_to_index=index,
            sampled_token_ids=sampled,
            logprobs=None if logprobs is None else logprobs.tolists(),
            prompt_logprobs_dict=prompt_logprobs,
            draft_token_ids=drafts,
        )

    return Materializer(materialize)


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return repr(error)
