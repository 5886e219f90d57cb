"""Speculative decoding on a static-shape device, chained on the device.

With ``--speculative-config`` (n-gram prompt lookup, or a draft model:
``draft_model.py``) every decode step is a *verify step*: each decode row
runs ``1 + K`` queries, its newest token and K drafts, at the static shape
``[decode bucket, 1 + K]`` (rows without drafts padded; a step where the
scheduler gave no row a draft runs at ``[bucket, 1]``). Everything the step
needs beyond the block table comes from the device's per-slot state
(``DeviceTokens``): the newest token, the drafts, the number of tokens known
(so the positions and KV slots), because under async scheduling the step
before has not told the host, or the scheduler, how many of its drafts were
accepted. vLLM's scheduler plans with the
optimistic count (all drafts accepted) and corrects it when the output lands;
the device always knows the true one.

On the device, in enqueue order: the verify forward (inputs from the slots,
then the model), then rejection sampling, the accepted tokens into the
histories, and the next drafts proposed from them (``ngram.py``, or the draft
model's forwards). The host learns the accepted tokens when the step retires,
as it learns sampled tokens.
"""

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import generate_uniform_probs
from vllm.v1.structured_output.utils import apply_grammar_bitmask

from vllm_neuron_sched.worker.ngram import propose_ngram_drafts
from vllm_neuron_sched.worker.results import Drafts, Verified, VerifyForward
from vllm_neuron_sched.worker.token_table import SPARE_TOKEN_SLOT

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.token_table import DeviceTokens

    # Per attention group, the plain metadata its builder turns into its own.
    AttentionInputs = list[tuple[AttentionGroup, CommonAttentionMetadata]]

# The proposers this runner runs on the device. "ngram_gpu" is vLLM's name for
# an n-gram proposer on the accelerator, the one vLLM's config check lets run
# with async scheduling; "ngram" is the same proposer for sync scheduling.
# "draft_model": a smaller model of the same vocabulary (sync and async).
NGRAM_METHODS = ("ngram", "ngram_gpu")
DRAFT_MODEL = "draft_model"
METHODS = (*NGRAM_METHODS, DRAFT_MODEL)
# Rejected positions in the rejection sampler's output.
REJECTED = -1
# A row whose temperature is below this samples greedily (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Speculation:
    """The engine's speculative decoding, fixed at start-up."""

    method: str
    num_tokens: int  # K: drafts per verify row
    # The model's config, whose max_model_len vLLM may lower once the KV
    # cache is sized (update_max_model_len): read, never copied.
    model_config: Any
    min_n: int = 0  # n-gram methods
    max_n: int = 0

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig") -> "Speculation | None":
        """None without speculation; a clear error for what is not run."""
        config = vllm_config.speculative_config
        if config is None:
            return None
        if config.method not in METHODS:
            raise ValueError(
                f"vllm_neuron_sched runs speculative decoding with the n-gram "
                f"proposer or a draft model on the device (method "
                f"{', '.join(map(repr, METHODS))}; 'ngram_gpu' keeps async "
                f"scheduling on); got method {config.method!r}"
            )
        _check_options(config)
        model_config = vllm_config.model_config
        if config.method == DRAFT_MODEL:
            _check_draft_model(vllm_config)
            return cls(config.method, config.num_speculative_tokens, model_config)
        assert config.prompt_lookup_min is not None
        assert config.prompt_lookup_max is not None
        return cls(
            config.method,
            config.num_speculative_tokens,
            model_config,
            min_n=config.prompt_lookup_min,
            max_n=config.prompt_lookup_max,
        )

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def history_len(self) -> int:
        """Columns of the device histories: every position a token can take."""
        return self.max_model_len + 1 + self.num_tokens


def _check_options(config: Any) -> None:
    """Options of vLLM's own verify step and proposers that these do not
    run: refused, never ignored."""
    refused = []
    if config.rejection_sample_method != "standard":
        refused.append(
            f"rejection_sample_method {config.rejection_sample_method!r} (drafts "
            "are verified by standard rejection sampling)"
        )
    if config.draft_sample_method != "greedy":
        refused.append(
            f"draft_sample_method {config.draft_sample_method!r} (a draft model "
            "proposes its greedy choices)"
        )
    if config.parallel_drafting:
        refused.append("parallel_drafting (a draft model drafts one token a pass)")
    for name in ("moe_backend", "attention_backend", "kv_cache_dtype"):
        if getattr(config, name, None) is not None:
            refused.append(f"{name} (the draft model runs with the model's)")
    if refused:
        raise ValueError(
            "vllm_neuron_sched does not run these speculative_config options: "
            + "; ".join(refused)
        )


def _check_draft_model(vllm_config: "VllmConfig") -> None:
    """What the draft's forwards need: its vocabulary is the target's (the
    verify step compares token ids), and it is sharded like the target (its
    TP ranks are the target's)."""
    config = vllm_config.speculative_config
    assert config is not None
    if config.use_heterogeneous_vocab:
        raise ValueError(
            "vllm_neuron_sched runs a draft model of the target's vocabulary "
            "only (speculative_config 'use_heterogeneous_vocab' is not supported)"
        )
    config.verify_equal_vocab_size_if_draft_model()
    target_len = vllm_config.model_config.max_model_len
    draft_len = config.draft_model_config.max_model_len
    if draft_len < target_len:
        raise ValueError(
            f"the draft model's max_model_len ({draft_len}) is below the model's "
            f"({target_len}): vllm_neuron_sched drafts at every position the "
            f"model runs; set --max-model-len {draft_len} or less"
        )
    target_tp = vllm_config.parallel_config.tensor_parallel_size
    draft_tp = config.draft_parallel_config.tensor_parallel_size
    if draft_tp != target_tp:
        raise ValueError(
            f"vllm_neuron_sched runs the draft model on the target's TP ranks: "
            f"speculative_config 'draft_tensor_parallel_size' must be "
            f"{target_tp} (the tensor_parallel_size), got {draft_tp}"
        )


@dataclass(frozen=True)
class AcceptedTokens:
    """Device side: what a sampling execution just added to each row's
    history, for the proposer: ``tokens[r, :counts[r]]`` at positions
    ``starts[r]`` on (rows with count 0 added nothing), and each row's block
    table per KV cache group (``[>= rows, columns]``)."""

    slots: torch.Tensor  # [rows] int64
    starts: torch.Tensor  # [rows] int64
    tokens: torch.Tensor  # [rows, W] int32 (REJECTED past the counts)
    counts: torch.Tensor  # [rows] int64
    tables: dict[int, torch.Tensor]


class Proposer(Protocol):
    """Device side: the next drafts of the rows in ``accepted``, into
    ``tokens.drafts`` and ``tokens.draft_counts``."""

    def propose(self, tokens: "DeviceTokens", accepted: AcceptedTokens) -> None: ...


@dataclass(frozen=True)
class NgramProposer:
    speculation: Speculation

    def propose(self, tokens: "DeviceTokens", accepted: AcceptedTokens) -> None:
        spec, slots = self.speculation, accepted.slots
        drafts, counts = propose_ngram_drafts(
            tokens.history,
            tokens.lengths[slots],
            slots,
            spec.num_tokens,
            spec.min_n,
            spec.max_n,
            spec.max_model_len,
        )
        tokens.drafts[slots] = drafts
        tokens.draft_counts[slots] = counts


@dataclass(frozen=True)
class VerifyPlan:
    """What the host knows of a verify step: the rows, their slots, how many
    drafts the scheduler gave each, and the block tables. The device derives
    the rest (``complete_on_device``)."""

    width: int  # queries per row: 1 + K, or 1 when no row has drafts
    num_rows: int
    num_rows_padded: int  # the decode bucket
    slots: torch.Tensor  # [num_rows] int64 token slots
    scheduled_drafts: torch.Tensor  # [num_rows] int64
    prompt_lens: torch.Tensor  # [num_rows] int64 (penalties count what follows)
    # Per attention group: the group and its rows' [num_rows, blocks] block
    # table (the device pads it to the step: ``rectangular_attention``).
    tables: "list[tuple[AttentionGroup, torch.Tensor]]"
    # (row, min_tokens, stop token ids) of the rows that set min_tokens.
    min_tokens: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def num_tokens_padded(self) -> int:
        return self.num_rows_padded * self.width


def plan_verify(
    batch: "InputBatch",
    scheduled_drafts: np.ndarray,
    token_slots: np.ndarray,
    num_rows_padded: int,
    num_spec_tokens: int,
    attn_groups: "list[AttentionGroup]",
    min_tokens: list[tuple[int, int, tuple[int, ...]]] | None = None,
) -> VerifyPlan:
    """Host side, from the scheduler's decisions only: no position, since the
    scheduler's ``num_computed_tokens`` may count drafts the device rejected
    (it plans optimistically). The block tables are copies: the input batch
    changes while the device runs."""
    num_rows = batch.num_reqs
    width = 1 + num_spec_tokens if scheduled_drafts.any() else 1
    tables = [
        (
            group,
            torch.from_numpy(
                batch.block_table[group.kv_cache_group_id]
                .get_numpy_array()[:num_rows]
                .copy()
            ),
        )
        for group in attn_groups
    ]
    return VerifyPlan(
        width=width,
        num_rows=num_rows,
        num_rows_padded=num_rows_padded,
        slots=torch.from_numpy(token_slots[:num_rows].copy()),
        scheduled_drafts=torch.from_numpy(scheduled_drafts.astype(np.int64)),
        prompt_lens=torch.from_numpy(
            batch.num_prompt_tokens[:num_rows].astype(np.int64)
        ),
        tables=tables,
        min_tokens=tuple(min_tokens or ()),
    )


@dataclass
class VerifyInputs:
    """A verify step's inputs, completed on the device."""

    input_ids: torch.Tensor  # [num_tokens_padded] int32
    positions: torch.Tensor  # [num_tokens_padded] int64
    slot_mapping: dict[str, torch.Tensor]
    attn_inputs: "list[tuple[AttentionGroup, CommonAttentionMetadata]]"
    num_drafts: torch.Tensor  # [num_rows] drafts each row verifies
    starts: torch.Tensor  # [num_rows] where each row's new tokens go


def complete_on_device(plan: VerifyPlan, tokens: "DeviceTokens") -> VerifyInputs:
    """Device side: row i's queries sit at ``[i * width, (i + 1) * width)``:
    the newest token at position ``length - 1``, then the drafts. Queries past
    a row's drafts, and padded rows, write no KV and are never sampled."""
    rows, width = plan.num_rows, plan.width
    lengths = tokens.lengths[plan.slots]
    num_drafts = torch.minimum(tokens.draft_counts[plan.slots], plan.scheduled_drafts)
    if width == 1:
        num_drafts = torch.zeros_like(num_drafts)
    ids = torch.zeros((plan.num_rows_padded, width), dtype=torch.int32)
    ids[:rows, 0] = tokens.read(plan.slots)
    ids[:rows, 1:] = tokens.drafts[plan.slots, : width - 1]
    positions = padded_positions(plan.num_rows_padded, width)
    positions[:rows] += (lengths - 1)[:, None]
    is_real = torch.zeros((plan.num_rows_padded, width), dtype=torch.bool)
    is_real[:rows] = positions[:rows] - (lengths - 1)[:, None] <= num_drafts[:, None]
    attn_inputs, slot_mapping = rectangular_attention(positions, is_real, plan.tables)
    return VerifyInputs(
        input_ids=ids.flatten(),
        positions=positions.flatten(),
        slot_mapping=slot_mapping,
        attn_inputs=attn_inputs,
        num_drafts=num_drafts,
        starts=lengths,
    )


@dataclass(frozen=True)
class VerifyGrammar:
    """A verify step's grammar masks, one per query of each structured row,
    and how many drafts each row may accept."""

    grammar_output: "GrammarOutput"  # the masks, padded to ``width`` per row
    layout: SimpleNamespace  # the rectangle, as vLLM's apply_grammar_bitmask reads it
    req_ids: list[str]
    draft_limit: torch.Tensor  # [num_rows] int64


def plan_grammar(
    grammar_output: "GrammarOutput",
    req_ids: list[str],
    scheduled_spec_tokens: dict[str, list[int]],
    width: int,
) -> VerifyGrammar:
    """Host side. vLLM's scheduler sends ``1 + scheduled drafts`` masks per
    structured request, mask ``j`` for the query after its first ``j``
    drafts, and how many leading drafts the grammar checked (under async
    scheduling only those it could read back: ``take_draft_token_ids``). Each
    request's masks are padded to ``width`` with permissive ones, which no
    output reads since the row's run stops at its last checked draft, so
    vLLM's ``apply_grammar_bitmask`` lays them on the ``[rows, width]``
    queries. A copy: the scheduler refills its mask buffer for the next step
    while this one runs."""
    ids = grammar_output.structured_output_request_ids
    source = grammar_output.grammar_bitmask
    acceptable = grammar_output.num_acceptable_drafts or [0] * len(ids)
    masks = np.full((len(ids) * width, source.shape[1]), -1, dtype=source.dtype)
    limit = torch.full((len(req_ids),), width - 1, dtype=torch.int64)
    row_of = {req_id: row for row, req_id in enumerate(req_ids)}
    start = 0
    for i, req_id in enumerate(ids):
        num_masks = 1 + len(scheduled_spec_tokens.get(req_id, ()))
        assert num_masks <= width, (req_id, num_masks, width)
        masks[i * width : i * width + num_masks] = source[start : start + num_masks]
        start += num_masks
        if (row := row_of.get(req_id)) is not None:
            limit[row] = acceptable[i]
    rectangle = {req_id: [REJECTED] * (width - 1) for req_id in (*req_ids, *ids)}
    return VerifyGrammar(
        replace(grammar_output, grammar_bitmask=masks),
        SimpleNamespace(scheduled_spec_decode_tokens=rectangle),
        list(req_ids),
        limit,
    )


def apply_verify_grammar(
    logits: torch.Tensor, num_drafts: torch.Tensor, grammar: VerifyGrammar
) -> torch.Tensor:
    """Device side: masks ``logits`` ([rows * width, vocab]) in place and
    returns the drafts each row may verify: no more than the grammar checked."""
    apply_grammar_bitmask(
        grammar.layout,
        grammar.grammar_output,
        SimpleNamespace(req_ids=grammar.req_ids),
        logits,
    )
    return torch.minimum(num_drafts, grammar.draft_limit)


def padded_positions(num_rows: int, width: int) -> torch.Tensor:
    """``[num_rows, width]`` positions ``0 .. width - 1`` per row: what a
    padded row of a rectangular step keeps (one sequence of ``width``)."""
    return torch.arange(width, dtype=torch.int64).repeat(num_rows, 1)


def rectangular_attention(
    positions: torch.Tensor,
    is_real: torch.Tensor,
    tables: "list[tuple[AttentionGroup, torch.Tensor]]",
) -> "tuple[AttentionInputs, dict[str, torch.Tensor]]":
    """Device side: attention for ``[rows, width]`` queries, each row one
    sequence whose queries sit at consecutive ``positions`` (a padded row's
    at ``padded_positions``). Queries not ``is_real`` write no KV, nor do
    positions whose block the table does not hold yet (the null block 0); a
    real query sees its own row's positions up to its own. ``tables``: per
    attention group, each row's blocks (``[>= real rows, columns]``; padded
    rows get the null block)."""
    num_rows, width = positions.shape
    seq_lens = (positions[:, -1] + 1).to(torch.int32)
    query_start_loc = torch.arange(0, num_rows * width + 1, width, dtype=torch.int32)
    flat_positions = positions.flatten()
    row_of = torch.arange(num_rows).repeat_interleave(width)
    slot_mapping: dict[str, torch.Tensor] = {}
    attn_inputs = []
    for group, rows_table in tables:
        block_size = group.kv_cache_spec.block_size
        real_rows = min(rows_table.shape[0], num_rows)
        columns = max(rows_table.shape[1], cdiv(int(seq_lens.max()), block_size))
        table = torch.zeros((num_rows, columns), dtype=rows_table.dtype)
        table[:real_rows, : rows_table.shape[1]] = rows_table[:real_rows]
        block = table[row_of, flat_positions // block_size].to(torch.int64)
        kv_slots = block * block_size + flat_positions % block_size
        kv_slots[~is_real.flatten() | (block == 0)] = -1
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            num_reqs=num_rows,
            num_actual_tokens=num_rows * width,
            max_query_len=width,
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table,
            slot_mapping=kv_slots,
            positions=flat_positions,
        )
        attn_inputs.append((group, common))
        for layer_name in group.layer_names:
            slot_mapping[layer_name] = kv_slots
    return attn_inputs, slot_mapping


def verify_on_device(
    proposer: Proposer,
    sampler: "Sampler",
    tokens: "DeviceTokens",
    forward: VerifyForward,
    metadata: "SamplingMetadata",
    plan: VerifyPlan,
    grammar: VerifyGrammar | None = None,
) -> Verified:
    """Device side, after the verify forward: the grammar's masks (in place,
    so the raw logprobs see them, as in vLLM), rejection sampling, the
    accepted tokens into the histories and the table, the next drafts."""
    with torch.inference_mode():
        num_drafts = forward.num_drafts
        if grammar is not None:
            num_drafts = apply_verify_grammar(forward.logits, num_drafts, grammar)
        logits, metadata = constrain_verify_logits(
            forward.logits, plan, tokens, metadata
        )
        sampled = rejection_sample(
            sampler,
            logits,
            plan.width,
            num_drafts,
            tokens.drafts[plan.slots],
            metadata,
        )
        accepted = (sampled != REJECTED).sum(dim=1)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = verify_logprobs(
                sampler, forward.logits, logits, sampled, metadata
            )
        tokens.accept(plan.slots, forward.starts, sampled, accepted)
        proposer.propose(
            tokens,
            AcceptedTokens(
                plan.slots,
                forward.starts,
                sampled,
                accepted,
                {group.kv_cache_group_id: table for group, table in plan.tables},
            ),
        )
        drafts = Drafts(
            tokens.drafts[plan.slots].clone(), tokens.draft_counts[plan.slots].clone()
        )
        return Verified(sampled, accepted, logprobs, drafts)


def constrain_verify_logits(
    logits: torch.Tensor,
    plan: VerifyPlan,
    tokens: "DeviceTokens",
    metadata: "SamplingMetadata",
) -> "tuple[torch.Tensor, SamplingMetadata]":
    """Device side: the allowed-token masks, min_tokens' stop masks, bad words
    and the penalties at every query of a verify step, and the metadata left
    for the sampler (without them).

    Query ``j`` of a row predicts the token after its ``j`` drafts, so its
    constraints see the row's output so far and those drafts, all read from
    the device history: under async scheduling the host's lists still hold
    placeholders. vLLM's ``apply_penalties`` does the arithmetic, as in stock
    sampling; vLLM's own rejection sampler counts the drafts the same way."""
    width = plan.width
    mask = metadata.allowed_token_ids_mask
    bad_words = metadata.bad_words_token_ids
    if metadata.no_penalties and mask is None and not plan.min_tokens and not bad_words:
        return logits, metadata
    logits = logits.clone()
    rows, vocab = plan.num_rows, logits.shape[1]
    lengths = tokens.lengths[plan.slots]
    if mask is not None:
        logits.masked_fill_(mask[:rows].repeat_interleave(width, 0), float("-inf"))
    # min_tokens: query j follows the row's outputs and j drafts.
    num_outputs = (lengths - plan.prompt_lens).tolist()
    for row, wanted, stops in plan.min_tokens:
        for j in range(min(width, max(0, wanted - num_outputs[row]))):
            logits[row * width + j, list(stops)] = float("-inf")
    if bad_words:
        # vLLM's rule per query, over the row's outputs and the query's drafts.
        queries: dict[int, list[list[int]]] = {}
        pasts: list[list[int]] = [[] for _ in range(rows * width)]
        for row, words in bad_words.items():
            slot = int(plan.slots[row])
            start, end = int(plan.prompt_lens[row]), int(lengths[row])
            outputs = tokens.history[slot, start:end].tolist()
            drafts = tokens.drafts[slot, : width - 1].tolist()
            for j in range(width):
                queries[row * width + j] = words
                pasts[row * width + j] = outputs + drafts[:j]
        apply_bad_words(logits, queries, pasts)
    if not metadata.no_penalties:
        assert metadata.prompt_token_ids is not None
        span = int(lengths.max()) + width - 1
        history = tokens.history[plan.slots, :span].long()
        if width > 1:
            columns = lengths[:, None] + torch.arange(width - 1)
            history = history.scatter(
                1, columns, tokens.drafts[plan.slots, : width - 1].long()
            )
        position = torch.arange(span)[None, None, :]
        ends = lengths[:, None] + torch.arange(width)[None, :]  # [rows, width]
        is_output = (position >= plan.prompt_lens[:, None, None]) & (
            position < ends[:, :, None]
        )
        outputs = torch.where(is_output, history[:, None, :], vocab)
        apply_penalties(
            logits,
            metadata.prompt_token_ids[:rows].repeat_interleave(width, 0),
            outputs.reshape(rows * width, span),
            metadata.presence_penalties[:rows].repeat_interleave(width),
            metadata.frequency_penalties[:rows].repeat_interleave(width),
            metadata.repetition_penalties[:rows].repeat_interleave(width),
        )
    # The sampler (the bonus tokens) must not apply them again; vLLM's
    # min_tokens processor would mask by the host's count, not the query's.
    processors = LogitsProcessors()
    processors.argmax_invariant = list(metadata.logitsprocs.argmax_invariant)
    processors.non_argmax_invariant = [
        p
        for p in metadata.logitsprocs.non_argmax_invariant
        if not isinstance(p, MinTokensLogitsProcessor)
    ]
    return logits, replace(
        metadata,
        no_penalties=True,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=processors,
    )


def verify_logprobs(
    sampler: "Sampler",
    raw_logits: torch.Tensor,
    constrained_logits: torch.Tensor,
    tokens: torch.Tensor,
    metadata: "SamplingMetadata",
) -> LogprobsTensors:
    """Logprobs of every query of a verify step (logits: [rows * width,
    vocab]; ``tokens``: [rows, width], what it output, ``REJECTED`` past each
    row's run), each row's ``width`` entries at ``row * width``: the
    scheduler keeps a row's first as many as it output. As vLLM's rejection
    sampler reports them, in the sampler's logprobs mode: the raw modes read
    the logits as the forward gave them; the processed modes read them after
    ``constrain_verify_logits``, then, unless every row is greedy, after
    temperature, top-k and top-p (``sampling_scaled``), at the drafts'
    queries as at the bonus token's."""
    mode = sampler.logprobs_mode
    rows, width = tokens.shape
    processed = mode.startswith("processed")
    scores = (constrained_logits if processed else raw_logits).float()
    if processed and not metadata.all_greedy:
        row_of = torch.arange(rows).repeat_interleave(width)
        scores = sampling_scaled(scores, metadata, row_of)
    if mode.endswith("logprobs"):
        scores = sampler.compute_logprobs(scores)
    ids = tokens.flatten().clamp(min=0).long()
    assert metadata.max_num_logprobs is not None
    token_ids, values, ranks, *_ = sampler.gather_logprobs(
        scores, metadata.max_num_logprobs, ids
    )
    return LogprobsTensors(
        token_ids,
        values,
        ranks,
        cu_num_generated_tokens=list(range(0, rows * width + 1, width)),
    )


def sampling_scaled(
    logits: torch.Tensor, metadata: "SamplingMetadata", row_of: torch.Tensor
) -> torch.Tensor:
    """``logits`` (a new tensor) divided by their rows' temperatures (1 for
    greedy rows) and masked to their top-k and top-p: the distribution a
    random row samples from, and vLLM's processed logits. ``row_of``: the
    batch row of each of ``logits``' rows."""
    assert metadata.temperature is not None
    temperature = metadata.temperature[row_of]
    temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    return apply_top_k_top_p(
        logits / temperature[:, None].float(),
        None if metadata.top_k is None else metadata.top_k[row_of],
        None if metadata.top_p is None else metadata.top_p[row_of],
    )


def rejection_sample(
    sampler: "Sampler",
    logits: torch.Tensor,
    width: int,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    metadata: "SamplingMetadata",
) -> torch.Tensor:
    """Speculative rejection sampling for drafts without probabilities
    (n-gram: the draft distribution is one-hot). ``logits``: [rows * width,
    vocab], row r's queries at ``r * width``. Returns [rows, width] tokens:
    each row's accepted drafts, then one token (the first rejection's
    replacement, or the bonus), then ``REJECTED``.

    A greedy row accepts a draft while it is the target's argmax and then
    takes the argmax (vLLM's greedy rule, so tokens equal stock vLLM's). A
    random row accepts draft d with probability p(d) under the target's
    temperature, top-k and top-p, and on rejection samples from p with d
    removed, which leaves the output distributed as p. Seeded rows draw from
    their own generators. vLLM's rejection sampler computes the same, but its
    CPU kernels corrupt random sampling in vLLM 0.32 (its ``expand``
    replacement copies 8 bytes per element; the random kernel returns an
    accepted draft with no token after it), so this is plain torch.
    """
    rows = num_drafts.shape[0]
    row_starts = torch.arange(rows) * width
    bonus = sampler(
        logits=logits[row_starts + num_drafts], sampling_metadata=metadata
    ).sampled_token_ids[:, 0]
    out = torch.full((rows, width), REJECTED, dtype=torch.int32)
    counts = num_drafts.tolist()
    k = width - 1
    if not k or not any(counts):
        out[:, 0] = bonus
        return out
    offsets = torch.arange(k)
    is_draft = offsets[None, :] < num_drafts[:, None]  # [rows, k]
    target = logits[(row_starts[:, None] + offsets)[is_draft]].float()  # [T, V]
    draft_ids = drafts[:, :k][is_draft].long()
    recovered = target.argmax(dim=-1)
    accept = recovered == draft_ids
    if not metadata.all_greedy:
        row_of = torch.arange(rows).repeat_interleave(num_drafts)
        is_greedy = (metadata.temperature < GREEDY_TEMPERATURE)[row_of]
        probs = sampling_scaled(target, metadata, row_of).softmax(dim=-1)
        uniform = generate_uniform_probs(
            draft_ids.shape[0], counts, metadata.generators, probs.device
        )
        random_accept = uniform < probs.gather(1, draft_ids[:, None])[:, 0]
        residual = probs.scatter(1, draft_ids[:, None], 0.0)
        noise_dtype = torch.float64 if sampler.use_fp64_gumbel else torch.float32
        noise = torch.empty((rows, probs.shape[1]), dtype=noise_dtype).exponential_()
        for row, generator in metadata.generators.items():
            if counts[row]:
                noise[row].exponential_(generator=generator)
        random_recovered = (residual / noise[row_of]).argmax(dim=-1)
        accept = torch.where(is_greedy, accept, random_accept)
        recovered = torch.where(is_greedy, recovered, random_recovered)
    accepted = torch.zeros((rows, k), dtype=torch.int64)
    accepted[is_draft] = accept.long()
    replacement = torch.zeros((rows, k), dtype=torch.int64)
    replacement[is_draft] = recovered
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # the leading run
    out[:, :k] = torch.where(
        offsets[None, :] < num_accepted[:, None], drafts[:, :k], REJECTED
    )
    last = torch.where(
        num_accepted < num_drafts,
        replacement.gather(1, num_accepted.clamp(max=k - 1)[:, None])[:, 0],
        bonus.long(),
    )
    out.scatter_(1, num_accepted[:, None], last[:, None].to(torch.int32))
    return out


def after_prompt_sampling(
    proposer: Proposer,
    tokens: "DeviceTokens",
    slots: torch.Tensor,
    positions: torch.Tensor,
    sampled: torch.Tensor,
    tables: dict[int, torch.Tensor],
) -> Drafts:
    """Device side, after a prompt's last chunk sampled its first token: the
    token into the history, and the first drafts, so the request's first
    decode step already verifies drafts. Rows that sample nothing write the
    spare slot and add nothing."""
    ones = torch.ones_like(positions)
    tokens.accept(slots, positions, sampled[:, None], ones)
    counts = torch.where(slots == SPARE_TOKEN_SLOT, 0, ones)
    proposer.propose(
        tokens, AcceptedTokens(slots, positions, sampled[:, None], counts, tables)
    )
    return Drafts(tokens.drafts[slots].clone(), tokens.draft_counts[slots].clone())
