"""On-device sampling and what the host hands it.

A step's rows sample on the device with the device's logits processors and
output histories (``sampling_state.py``). A step that needs only what vLLM's
sampler applies per request (allowed tokens, bad words, ``min_tokens``,
logit bias, penalties: ``logits_rules.py``), temperature, top-k, top-p,
``min_p`` and logprobs samples in programs of fixed shape: the rules,
then ``sample_rows`` after the per-request draws the host makes at enqueue
(``draw_sampling``); an engine with logits processors of the user's
samples with vLLM's ``Sampler`` (their Python acts on the logits). On a
threaded device the rest of what it reads is a snapshot taken at enqueue,
because the main thread builds the next step while this one samples; an
inline device samples at enqueue and reads the batch as it is.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm._custom_ops  # noqa: F401  (loads the CPU sampling kernels)
from torch._library.simple_registry import singleton as _op_registry
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from vllm_neuron_sched.worker.logits_rules import (
    NO_RULES,
    QueryPasts,
    RowRules,
    any_rule,
    constrain_queries,
    reads_history,
)
from vllm_neuron_sched.worker.results import Sampled

logger = init_logger(__name__)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_neuron_sched.worker.inputs import StepInputs
    from vllm_neuron_sched.worker.programs import Programs
    from vllm_neuron_sched.worker.sampling_state import SamplingState
    from vllm_neuron_sched.worker.token_table import DeviceTokens

# A row whose temperature is below this samples greedily (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5


def sampling_inputs(
    metadata: "SamplingMetadata",
    grammar: "tuple[SchedulerOutput, GrammarOutput] | None",
    req_ids: list[str],
    snapshot: bool,
    drawn_for: "tuple[StepInputs, Sampler, int] | None" = None,
) -> "tuple[SamplingMetadata, bool, StepMasks | None, Draws | None]":
    """Host side, at enqueue: what a sampling execution of these rows reads
    besides its logits and the device's sampling state: the metadata (a
    snapshot when ``snapshot``: a threaded device), whether the sampler
    reads histories, the step's own grammar masks, and where the programs
    sample (``drawn_for``: the step's inputs, the sampler, the vocabulary)
    the rows' draws (``draw_sampling``)."""
    needs_histories = bool(metadata.output_token_ids)
    if snapshot:
        metadata = snapshot_sampling_metadata(metadata)
    masks = None if grammar is None else own_masks(*grammar, req_ids)
    draws = None
    if drawn_for is not None:
        inputs, sampler, vocab = drawn_for
        draws = draw_sampling(
            metadata, inputs.is_sampled, vocab, noise_dtype(sampler), inputs.rules.min_p
        )
    return metadata, needs_histories, masks, draws


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
    programs: "Programs",
    tokens: "DeviceTokens",
    state: "SamplingState",
    logits: torch.Tensor,
    metadata: "SamplingMetadata",
    needs_histories: bool,
    inputs: "StepInputs",
    grammar: "StepMasks | None",
    draws: "Draws | None",
) -> Sampled:
    """Runs on the device thread. Samples in the programs (``draws``: the
    host's, ``draw_sampling``), or with the user's processors by vLLM's
    sampler, writes each sampling row's token into the device token table
    and history (``inputs.sample_slots``: non-sampling rows point at the
    spare slot) and the processors' histories, and returns the tokens and
    their logprobs."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    req_ids, is_sampled = inputs.req_ids, inputs.is_sampled
    with torch.inference_mode():
        metadata = state.sampling_metadata(metadata, req_ids, needs_histories)
        if grammar is not None:
            rows = SimpleNamespace(req_ids=grammar.req_ids)
            apply_grammar_bitmask(_NO_DRAFTS, grammar.grammar_output, rows, logits)
        if not state.user_processors:
            sampled, logprobs = sample_in_program(
                sampler,
                programs,
                logits,
                metadata,
                draws,
                inputs.rules,
                _plain_pasts(tokens, inputs, reads_history(inputs.rules, metadata)),
            )
        else:
            sampled, logprobs = _vllm_sample(sampler, logits, metadata, is_sampled)
        tokens.accept_sampled(inputs.sample_slots, inputs.next_positions, sampled)
        state.record(req_ids, sampled[:, None], torch.from_numpy(is_sampled))
    return Sampled(sampled, logprobs)


def _plain_pasts(
    tokens: "DeviceTokens", inputs: "StepInputs", with_history: bool
) -> QueryPasts:
    """A plain step's rows' pasts: one query each, ending before the token
    it samples; the device histories only where a rule reads them."""
    history = None
    if with_history:
        slots = torch.from_numpy(inputs.token_slots)
        history = tokens.histories_of(slots)[0].long()
    return QueryPasts(history, inputs.next_positions[:, None], inputs.prompt_lens)


def sample_in_program(
    sampler: "Sampler",
    programs: "Programs",
    logits: torch.Tensor,
    metadata: "SamplingMetadata",
    draws: "Draws | None",
    rules: RowRules = NO_RULES,
    pasts: QueryPasts | None = None,
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """The rows' rules (``logits_rules.py``, one query per row: ``pasts``
    where any acts), the sampling program after the host's ``draws``, then
    the logprobs (``_logprobs``, from the scores the programs give). A raw
    logprobs mode reads the logits before the rules (``raw_scores``), as
    vLLM's sampler does."""
    num_logprobs = metadata.max_num_logprobs
    token_ids = metadata.logprob_token_ids
    scores_mode = None
    if num_logprobs is not None or token_ids:
        scores_mode = sampler.logprobs_mode
    scores = None
    logits = logits.float()  # as vLLM's sampler takes them
    if any_rule(rules, metadata):
        assert pasts is not None
        if scores_mode is not None and scores_mode.startswith("raw"):
            scores, scores_mode = programs.raw_scores(logits, scores_mode), None
        logits = constrain_queries(programs, logits[:, None], rules, metadata, pasts)
        logits = logits[:, 0]
    sampled, processed = programs.sample_rows(logits, draws, scores_mode)
    scores = processed if scores is None else scores
    if scores is None:
        return sampled.to(torch.int32), None
    return sampled.to(torch.int32), _logprobs(sampler, scores, metadata, sampled)


def _logprobs(
    sampler: "Sampler",
    scores: torch.Tensor,
    metadata: "SamplingMetadata",
    sampled: torch.Tensor,
) -> LogprobsTensors | None:
    """What vLLM's sampler reports from the scores: given tokens' logprobs
    where a row asks for them (they win over the top-n), the whole
    vocabulary's, unsorted and unranked, for n = -1, else the top-n beside
    the sampled token's (vLLM's gathers, at the batch's n or list)."""
    token_ids = metadata.logprob_token_ids
    if token_ids:
        return sampler.gather_specific_token_logprobs(scores, token_ids, sampled)
    num_logprobs = metadata.max_num_logprobs
    if num_logprobs == -1:
        return LogprobsTensors(torch.empty(0), scores, torch.empty(0))
    assert num_logprobs is not None
    return sampler.gather_logprobs(scores, num_logprobs, sampled)


def _vllm_sample(
    sampler: "Sampler",
    logits: torch.Tensor,
    metadata: "SamplingMetadata",
    is_sampled: np.ndarray,
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """vLLM's sampler, for what ``sample_rows`` does not do."""
    # A prompt chunk that is not the last samples nothing: its seeded
    # generator must not advance, so seeds reproduce however it is chunked.
    kept_states = {
        row: metadata.generators[row].get_state()
        for row in np.flatnonzero(~is_sampled).tolist()
        if row in metadata.generators
    }
    output = sampler(logits=logits, sampling_metadata=metadata)
    for row, generator_state in kept_states.items():
        metadata.generators[row].set_state(generator_state)
    return output.sampled_token_ids[:, 0].to(torch.int32), output.logprobs_tensors


@dataclass(frozen=True)
class Draws:
    """What a step's random rows draw before ``sample_rows``, as vLLM's CPU
    sampler draws them: a seed per row for its Gumbel-max kernel, or with
    fp64 Gumbel noise (``use_fp64_gumbel``) an exponential per vocabulary
    entry; a seeded row's from its own generator. With them each row's
    ``min_p`` (0 for none: it masks nothing, and the step keeps one graph
    whether a row sets it or not)."""

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor | None  # [rows] int32
    top_p: torch.Tensor | None  # [rows] float32
    seeds: torch.Tensor | None  # [rows] int64
    noise: torch.Tensor | None  # [rows, vocab] float64
    min_p: torch.Tensor  # [rows] float32


def draw_sampling(
    metadata: "SamplingMetadata",
    is_sampled: np.ndarray,
    vocab: int,
    noise_dtype: torch.dtype,
    min_p: torch.Tensor | None = None,
) -> Draws | None:
    """Host side, at enqueue: the per-request step before ``sample_rows``
    (its generators are host objects, drawn from in step order on the host
    thread alone). None when every row is greedy. A row that samples nothing (a
    prompt chunk that is not the last) draws nothing from its generator, so
    seeds reproduce however a prompt is chunked. ``min_p``: the rows'
    (``plan_rules``), None when no row sets it."""
    if metadata.all_greedy:
        return None
    assert metadata.temperature is not None
    rows = metadata.temperature.shape[0]
    generators = [
        (row, generator)
        for row, generator in metadata.generators.items()
        if is_sampled[row]
    ]
    seeds = noise = None
    if noise_dtype == torch.float64:
        noise = torch.empty((rows, vocab), dtype=noise_dtype).exponential_()
        for row, generator in generators:
            noise[row].exponential_(generator=generator)
    else:
        seeds = torch.randint(0, 2**31, (rows,), dtype=torch.long)
        for row, generator in generators:
            seeds[row] = torch.randint(
                0, 2**31, (1,), generator=generator, dtype=torch.long
            )[0]
    if min_p is None:
        min_p = torch.zeros(rows, dtype=torch.float32)
    return Draws(
        metadata.temperature, metadata.top_k, metadata.top_p, seeds, noise, min_p
    )


def sample_rows(
    logits: torch.Tensor, draws: Draws | None, scores_mode: str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The device program: ``logits`` [rows, vocab] float32 (vLLM's sampler
    casts a model's other dtype first, and so does the step) -> each row's
    token [rows] int64 as vLLM's CPU sampler takes it (the argmax for a
    greedy row; for a random one Gumbel-max over the logits after
    temperature, min_p, top-k and top-p), with vLLM's own kernels, so tokens and
    seeds equal stock's; and with a logprobs mode (vLLM's ``logprobs_mode``)
    the [rows, vocab] float32 scores its sampler reads logprobs from in that
    mode."""
    greedy = torch.ops._C.greedy_argmax(logits)
    if draws is None:
        tokens, processed = greedy, logits
    else:
        temperature = draws.temperature
        processed = sampling_scaled(
            logits, 1, temperature, draws.top_k, draws.top_p, draws.min_p
        )
        if draws.seeds is not None:
            drawn = torch.ops._C.fused_gumbel_argmax(processed, draws.seeds)
        else:
            assert draws.noise is not None
            probs = processed.softmax(dim=-1, dtype=torch.float32)
            drawn = (draws.noise.reciprocal() * probs).argmax(dim=-1)
        tokens = torch.where(temperature < GREEDY_TEMPERATURE, greedy, drawn)
    if scores_mode is None:
        return tokens, None
    return tokens, logprobs_scores(logits, processed, scores_mode)


def logprobs_scores(
    raw: torch.Tensor, processed: torch.Tensor, mode: str
) -> torch.Tensor:
    """What vLLM's logprobs ``mode`` reads, float32: the raw modes the logits
    as the forward gave them, the processed ones what the rows sample from
    (``processed``: after temperature, min_p, top-k and top-p unless every
    row is greedy, greedy rows at temperature 1); log-softmaxed for the logprobs
    modes."""
    source = processed if mode.startswith("processed") else raw.float()
    if mode.endswith("logprobs"):
        return source.log_softmax(dim=-1, dtype=torch.float32)
    return source


def raw_scores(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The device program for a raw logprobs mode's scores where a step
    processes its logits before ``sample_rows`` (``logits_rules.py``): read
    from the logits as the forward gave them."""
    return logprobs_scores(logits, logits, mode)


def sampling_scaled(
    logits: torch.Tensor,
    queries_per_row: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits`` (a new tensor), ``queries_per_row`` consecutive ones per
    batch row, divided by their rows' temperatures (1 for greedy rows),
    masked where a token's probability is below ``min_p`` times the row's
    largest (vLLM's min_p processor, which runs between the two) and to
    their top-k and top-p: the distribution a random row samples from, and
    vLLM's processed logits. The settings hold one entry per batch row.
    vLLM's sort-based masks, which keep the shape static (its top-k-only
    path reads the largest k back to the host, and masks the same
    tokens)."""

    def per_query(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.repeat_interleave(queries_per_row)

    temperature = temperature.repeat_interleave(queries_per_row)
    temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    scaled = logits / temperature[:, None].float()
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * per_query(min_p)[:, None]
        scaled = scaled.masked_fill(probs < floor, -torch.inf)
    return apply_top_k_top_p_pytorch(
        scaled, per_query(top_k), per_query(top_p), allow_cpu_sync=False
    )


def noise_dtype(sampler: "Sampler") -> torch.dtype:
    """The Gumbel noise's dtype, as vLLM's sampler draws it."""
    return torch.float64 if sampler.use_fp64_gumbel else torch.float32


def _register_fake_kernels() -> None:
    """vLLM's CPU sampling kernels have no fake implementation, which a
    compiler needs to trace a program that calls them (the shapes out)."""
    for name in ("_C::greedy_argmax", "_C::fused_gumbel_argmax"):
        if _op_registry.find(name).fake_impl.kernel is None:
            torch.library.register_fake(name, _one_token_per_row)


def _one_token_per_row(logits: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


_register_fake_kernels()


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
