"""On-device sampling and what the host hands it.

The sampler runs on the device (vLLM's ``Sampler``: penalties, top-k/p, min-p,
seeds, logprobs) with the device's logits processors and output histories
(``sampling_state.py``). On a threaded device the rest of what it reads is a
snapshot taken at enqueue, because the main thread builds the next step while
this one samples; an inline device samples at enqueue and reads the batch as
it is.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors

from vllm_neuron_sched.worker.results import Sampled

logger = init_logger(__name__)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.worker.sampling_state import SamplingState
    from vllm_neuron_sched.worker.token_table import DeviceTokens


def sampling_inputs(
    metadata: "SamplingMetadata",
    grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
    req_ids: list[str],
    snapshot: bool,
) -> "tuple[SamplingMetadata, bool, StepMasks | None]":
    """Host side, at enqueue: what a sampling execution of these rows reads
    besides its logits and the device's sampling state: the metadata (a
    snapshot when ``snapshot``: a threaded device), whether the sampler
    reads histories, the step's own grammar masks."""
    needs_histories = bool(metadata.output_token_ids)
    if snapshot:
        metadata = snapshot_sampling_metadata(metadata)
    masks = None if grammar is None else own_masks(*grammar, req_ids)
    return metadata, needs_histories, masks


def snapshot_sampling_metadata(metadata: "SamplingMetadata") -> "SamplingMetadata":
    """A copy the device may read while the host mutates the input batch
    (threaded devices only: an inline device samples at enqueue): tensors
    cloned, the generator and bad-words maps copied. The histories and the
    logits processors are the device's own (``sampling_state.py``)."""

    def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.clone()

    return replace(
        metadata,
        temperature=clone(metadata.temperature),
        top_p=clone(metadata.top_p),
        top_k=clone(metadata.top_k),
        frequency_penalties=clone(metadata.frequency_penalties),
        presence_penalties=clone(metadata.presence_penalties),
        repetition_penalties=clone(metadata.repetition_penalties),
        allowed_token_ids_mask=clone(metadata.allowed_token_ids_mask),
        output_token_ids=[],
        generators=dict(metadata.generators),
        bad_words_token_ids=dict(metadata.bad_words_token_ids),
        spec_token_ids=None,
    )


def sample_on_device(
    sampler: "Sampler",
    tokens: "DeviceTokens",
    state: "SamplingState",
    logits: torch.Tensor,
    metadata: "SamplingMetadata",
    needs_histories: bool,
    req_ids: list[str],
    write_slots: torch.Tensor,
    is_sampled: np.ndarray,
    grammar: "StepMasks | None",
) -> Sampled:
    """Runs on the device thread. Samples with the device's processors and
    histories, writes each sampling row's token into the device token table
    (``write_slots``; non-sampling rows point at the padding slot) and the
    histories, and returns the tokens and their logprobs."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    with torch.inference_mode():
        metadata = state.sampling_metadata(metadata, req_ids, needs_histories)
        if grammar is not None:
            rows = SimpleNamespace(req_ids=grammar.req_ids)
            apply_grammar_bitmask(_NO_DRAFTS, grammar.grammar_output, rows, logits)
        # A prompt chunk that is not the last samples nothing: its seeded
        # generator must not advance, so seeds reproduce however it is chunked.
        kept_states = {
            row: metadata.generators[row].get_state()
            for row in np.flatnonzero(~is_sampled).tolist()
            if row in metadata.generators
        }
        output = sampler(logits=logits, sampling_metadata=metadata)
        sampled = output.sampled_token_ids[:, 0].to(torch.int32)
        for row, generator_state in kept_states.items():
            metadata.generators[row].set_state(generator_state)
        tokens.write(write_slots, sampled)
        state.record(
            req_ids,
            [[t] if s else [] for t, s in zip(sampled.tolist(), is_sampled.tolist())],
        )
    return Sampled(sampled, output.logprobs_tensors)


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


@dataclass(frozen=True)
class StepMasks:
    """A sampling step's own grammar masks, one per structured request: the
    mask for the token it samples, in vLLM's ``grammar_output`` order."""

    grammar_output: "GrammarOutput"
    req_ids: list[str]  # the step's rows, in order


# What vLLM's apply_grammar_bitmask reads of a scheduler output: a sampling
# step runs no drafts, so each structured request has one logits row.
_NO_DRAFTS = SimpleNamespace(scheduled_spec_decode_tokens={})


def own_masks(
    scheduler_output: "SchedulerOutput",
    grammar_output: "GrammarOutput",
    req_ids: Sequence[str],
) -> StepMasks:
    """Host side, at enqueue. vLLM sends ``1 + drafts`` masks per structured
    request; the only drafts a sampling step (not a verify step) is
    scheduled are the placeholders vLLM pads a one-token prompt rest with
    (a prefix-cache hit) under speculation, which the step does not run: it
    samples once, under the first mask. A copy: the scheduler refills its
    mask buffer for the next step while this one may still sample, and the
    execution reads nothing of the live scheduler output."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    ids = grammar_output.structured_output_request_ids
    firsts = np.cumsum([0] + [1 + len(drafts.get(r, ())) for r in ids[:-1]])
    masks = grammar_output.grammar_bitmask[firsts]  # a copy
    return StepMasks(replace(grammar_output, grammar_bitmask=masks), list(req_ids))
