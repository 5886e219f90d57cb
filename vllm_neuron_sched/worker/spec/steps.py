"""The step kinds of an engine that speculates: a prefill step that also
feeds the proposer, and the verify step (``verify.py``) for decode. Steps
that mix prefill and decode are refused: the verify step's static shape
holds decode rows only."""

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron_sched.worker.inputs import StepInputs
from vllm_neuron_sched.worker.results import Sampled
from vllm_neuron_sched.worker.spec.proposer import after_prompt_sampling
from vllm_neuron_sched.worker.spec.verify import VerifyStep
from vllm_neuron_sched.worker.steps import PrefillStep, StepKinds, StepRows

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_neuron_sched.worker.host_state import HostRequestState, StepUpdate
    from vllm_neuron_sched.worker.layout import Tokens
    from vllm_neuron_sched.worker.lora import StepAdapters
    from vllm_neuron_sched.worker.sampling import StepMasks
    from vllm_neuron_sched.worker.steps import StepContext

# (token slots, positions, token ids) a prefill step writes into the device
# histories.
HistoryWrites = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ProposingPrefillStep(PrefillStep):
    """A prefill step whose prompt tokens also go into the device histories
    the n-gram proposer reads (and through the draft model, when that
    proposes), and whose last chunks' first tokens get their first drafts,
    so a request's first decode step already verifies drafts."""

    drafts = True

    def __init__(
        self,
        inputs: StepInputs,
        num_new_tokens: np.ndarray,
        history_writes: HistoryWrites,
        next_positions: torch.Tensor,
        adapters: "StepAdapters | None" = None,
    ) -> None:
        super().__init__(inputs, num_new_tokens, adapters)
        self.history_writes = history_writes
        self.next_positions = next_positions

    @classmethod
    def build(
        cls,
        ctx: "StepContext",
        host: "HostRequestState",
        rows: StepRows,
        update: "StepUpdate",
    ) -> "ProposingPrefillStep":
        # vLLM pads a prompt whose prefix-cache hit leaves it one token to
        # ``1 + K`` tokens with K placeholder drafts (uniform verify shapes
        # for its CUDA graphs). Such a row runs its one prompt token
        # (``rows.num_run``) and samples from it; the scheduler counts the
        # placeholders as rejected drafts, so they are the row's
        # placeholders too.
        inputs = cls.inputs_of(ctx, rows, update)
        return cls(
            inputs,
            inputs.is_sampled.astype(np.int64) + rows.num_drafts,
            _history_writes(
                update.batch,
                update.num_cached_prompt_tokens,
                update.token_slots,
                inputs.layout.tokens,
            ),
            torch.from_numpy(rows.num_computed + rows.num_run),
            cls.adapters_of(ctx, update, inputs),
        )

    def run_model_on_device(self, ctx: "StepContext") -> torch.Tensor:
        assert ctx.proposer is not None
        ctx.token_table.record(*self.history_writes)
        hidden_states = super().run_model_on_device(ctx)
        ctx.proposer.prefill(self.inputs)
        return hidden_states

    def sample_on_device(
        self,
        ctx: "StepContext",
        logits: torch.Tensor,
        metadata: "SamplingMetadata",
        needs_histories: bool,
        grammar: "StepMasks | None",
    ) -> Sampled:
        assert ctx.proposer is not None
        sampled = super().sample_on_device(
            ctx, logits, metadata, needs_histories, grammar
        )
        with torch.inference_mode():
            drafts = after_prompt_sampling(
                ctx.proposer,
                ctx.token_table,
                self.inputs.sample_slots,
                self.next_positions,
                sampled.tokens,
                self.inputs.layout.tables,
            )
        return replace(sampled, drafts=drafts)


def _history_writes(
    batch: "InputBatch",
    num_cached_prompt_tokens: np.ndarray,
    token_slots: np.ndarray,
    tokens: "Tokens",
) -> HistoryWrites:
    """Every prompt token the step runs, and a new request's prefix-cache
    hit, which it does not run but the n-gram proposer reads."""
    hit_rows = np.flatnonzero(num_cached_prompt_tokens)
    hits = num_cached_prompt_tokens[hit_rows]
    hit_rows_of_token = np.repeat(hit_rows, hits)
    hit_positions = np.arange(int(hits.sum())) - np.repeat(np.cumsum(hits) - hits, hits)
    rows = np.concatenate([hit_rows_of_token, tokens.row_of_token])
    columns = np.concatenate([hit_positions, tokens.positions])
    return (
        torch.from_numpy(token_slots[rows]),
        torch.from_numpy(columns),
        torch.from_numpy(batch.token_ids_cpu[rows, columns].astype(np.int32)),
    )


SPECULATIVE_STEPS = StepKinds(
    ProposingPrefillStep,
    VerifyStep,
    None,
    "speculative decoding's verify step holds decode rows only; it needs a "
    "scheduler that never mixes them with prefill (the vllm_neuron_sched ones)",
)
