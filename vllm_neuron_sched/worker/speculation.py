"""Speculative decoding on a static-shape device, chained on the device.

With ``--speculative-config`` (n-gram prompt lookup) every decode step is a
*verify step*: each decode row runs ``1 + K`` queries, its newest token and K
drafts, at the static shape ``[decode bucket, 1 + K]`` (rows without drafts
padded; a step where the scheduler gave no row a draft runs at
``[bucket, 1]``). Everything the step needs beyond the block table comes from
the device's per-slot state (``DeviceTokens``): the newest token, the drafts,
the number of tokens known (so the positions and KV slots), because under
async scheduling the step before has not told the host, or the scheduler,
how many of its drafts were accepted. vLLM's scheduler plans with the
optimistic count (all drafts accepted) and corrects it when the output lands;
the device always knows the true one.

On the device, in enqueue order: the verify forward (inputs from the slots,
then the model), then rejection sampling, the accepted tokens into the
histories, and the next drafts proposed from them (``ngram.py``). The host
learns the accepted tokens when the step retires, as it learns sampled tokens.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import generate_uniform_probs

from vllm_neuron_sched.worker.ngram import propose_ngram_drafts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.token_table import DeviceTokens

# The proposers this runner runs on the device. "ngram_gpu" is vLLM's name for
# an n-gram proposer on the accelerator, the one vLLM's config check lets run
# with async scheduling; "ngram" is the same proposer for sync scheduling.
METHODS = ("ngram", "ngram_gpu")
# Rejected positions in the rejection sampler's output.
REJECTED = -1


@dataclass(frozen=True)
class Speculation:
    """The engine's speculative decoding, fixed at start-up."""

    num_tokens: int  # K: drafts per verify row
    min_n: int
    max_n: int
    max_model_len: int

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig") -> "Speculation | None":
        """None without speculation; a clear error for what is not run."""
        config = vllm_config.speculative_config
        if config is None:
            return None
        if config.method not in METHODS:
            raise ValueError(
                f"vllm_neuron_sched runs speculative decoding with the n-gram "
                f"proposer on the device (method {' or '.join(map(repr, METHODS))}; "
                f"'ngram_gpu' keeps async scheduling on); got method "
                f"{config.method!r}"
            )
        assert config.prompt_lookup_min is not None
        assert config.prompt_lookup_max is not None
        return cls(
            num_tokens=config.num_speculative_tokens,
            min_n=config.prompt_lookup_min,
            max_n=config.prompt_lookup_max,
            max_model_len=vllm_config.model_config.max_model_len,
        )

    @property
    def history_len(self) -> int:
        """Columns of the device histories: every position a token can take."""
        return self.max_model_len + 1 + self.num_tokens

    def propose(self, tokens: "DeviceTokens", slots: torch.Tensor) -> None:
        """Device side: the next drafts of these slots, from their histories."""
        drafts, counts = propose_ngram_drafts(
            tokens.history,
            tokens.lengths[slots],
            slots,
            self.num_tokens,
            self.min_n,
            self.max_n,
            self.max_model_len,
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
    # Per attention group: the group, its [num_rows_padded, blocks] table
    # (padded rows and columns: the null block 0) and its block size.
    tables: "list[tuple[AttentionGroup, torch.Tensor, int]]"

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
) -> VerifyPlan:
    """Host side, from the scheduler's decisions only. The scheduler's
    ``num_computed_tokens`` may count drafts the device rejected (it plans
    optimistically), so it serves as an upper bound: for the block tables'
    width, never for a position."""
    num_rows = batch.num_reqs
    width = 1 + num_spec_tokens if scheduled_drafts.any() else 1
    bound = int(batch.num_computed_tokens_cpu[:num_rows].max()) + width
    tables = []
    for group in attn_groups:
        block_table = batch.block_table[group.kv_cache_group_id]
        table_np = block_table.get_numpy_array()
        columns = max(table_np.shape[1], -(-bound // block_table.block_size))
        table = np.zeros((num_rows_padded, columns), dtype=np.int32)
        table[:num_rows, : table_np.shape[1]] = table_np[:num_rows]
        tables.append((group, torch.from_numpy(table), block_table.block_size))
    return VerifyPlan(
        width=width,
        num_rows=num_rows,
        num_rows_padded=num_rows_padded,
        slots=torch.from_numpy(token_slots[:num_rows].copy()),
        scheduled_drafts=torch.from_numpy(scheduled_drafts.astype(np.int64)),
        tables=tables,
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
    offsets = torch.arange(width)
    positions = torch.zeros((plan.num_rows_padded, width), dtype=torch.int64)
    positions[:rows] = (lengths - 1)[:, None] + offsets
    is_real = torch.zeros((plan.num_rows_padded, width), dtype=torch.bool)
    is_real[:rows] = offsets[None, :] <= num_drafts[:, None]
    seq_lens = torch.full((plan.num_rows_padded,), width, dtype=torch.int32)
    seq_lens[:rows] = (lengths - 1 + width).to(torch.int32)
    query_start_loc = torch.arange(
        0, plan.num_tokens_padded + 1, width, dtype=torch.int32
    )
    flat_positions = positions.flatten()
    slot_mapping: dict[str, torch.Tensor] = {}
    attn_inputs = []
    for group, table, block_size in plan.tables:
        row_of = torch.arange(plan.num_rows_padded).repeat_interleave(width)
        block = table[
            row_of, (flat_positions // block_size).clamp(max=table.shape[1] - 1)
        ]
        kv_slots = block.to(torch.int64) * block_size + flat_positions % block_size
        kv_slots[~is_real.flatten()] = -1
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            num_reqs=plan.num_rows_padded,
            num_actual_tokens=plan.num_tokens_padded,
            max_query_len=width,
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table,
            slot_mapping=kv_slots,
            positions=flat_positions,
        )
        attn_inputs.append((group, common))
        for layer_name in group.layer_names:
            slot_mapping[layer_name] = kv_slots
    return VerifyInputs(
        input_ids=ids.flatten(),
        positions=flat_positions,
        slot_mapping=slot_mapping,
        attn_inputs=attn_inputs,
        num_drafts=num_drafts,
        starts=lengths,
    )


def verify_on_device(
    speculation: Speculation,
    sampler: "Sampler",
    tokens: "DeviceTokens",
    forward: dict[str, Any],
    metadata: "SamplingMetadata",
    plan: VerifyPlan,
) -> dict[str, Any]:
    """Device side, after the verify forward: rejection sampling, the
    accepted tokens into the histories and the table, the next drafts."""
    with torch.inference_mode():
        sampled = rejection_sample(
            sampler,
            forward["logits"],
            plan.width,
            forward["num_drafts"],
            tokens.drafts[plan.slots],
            metadata,
        )
        accepted = (sampled != REJECTED).sum(dim=1)
        tokens.accept(plan.slots, forward["starts"], sampled, accepted)
        speculation.propose(tokens, plan.slots)
        return {
            "tokens": sampled,
            "counts": accepted,
            "drafts": tokens.drafts[plan.slots].clone(),
            "draft_counts": tokens.draft_counts[plan.slots].clone(),
        }


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
        is_greedy = (metadata.temperature < 1e-5)[row_of]
        temperature = torch.where(is_greedy, 1.0, metadata.temperature[row_of])
        scaled = apply_top_k_top_p(
            target / temperature[:, None].float(),
            None if metadata.top_k is None else metadata.top_k[row_of],
            None if metadata.top_p is None else metadata.top_p[row_of],
        )
        probs = scaled.softmax(dim=-1)
        uniform = generate_uniform_probs(
            draft_ids.shape[0], counts, metadata.generators, probs.device
        )
        random_accept = uniform < probs.gather(1, draft_ids[:, None])[:, 0]
        residual = probs.scatter(1, draft_ids[:, None], 0.0)
        noise = torch.empty((rows, probs.shape[1])).exponential_()
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
    speculation: Speculation,
    tokens: "DeviceTokens",
    slots: torch.Tensor,
    positions: torch.Tensor,
    sampled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Device side, after a prompt's last chunk sampled its first token: the
    token into the history, and the first drafts, so the request's first
    decode step already verifies drafts."""
    tokens.accept(slots, positions, sampled[:, None], torch.ones_like(positions))
    speculation.propose(tokens, slots)
    return {
        "drafts": tokens.drafts[slots].clone(),
        "draft_counts": tokens.draft_counts[slots].clone(),
    }
