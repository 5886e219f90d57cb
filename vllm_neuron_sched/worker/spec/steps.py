"""The step kinds of an engine that speculates: a prefill step that also
feeds the proposer, and the verify step (``verify.py``) for decode. Steps
that mix prefill and decode are refused: the verify step's static shape
holds decode rows only."""

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron_sched.worker.results import Sampled
from vllm_neuron_sched.worker.spec.proposer import after_prompt_sampling
from vllm_neuron_sched.worker.spec.verify import VerifyStep
from vllm_neuron_sched.worker.steps import PrefillStep, StepKinds, StepRows

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_neuron_sched.worker.host_state import HostRequestState, StepUpdate
    from vllm_neuron_sched.worker.sampling import Draws, StepMasks
    from vllm_neuron_sched.worker.steps import StepContext


class ProposingPrefillStep(PrefillStep):
    """A prefill step that also feeds the proposer (the draft model, when
    that proposes; the n-gram proposer reads the device histories every
    step writes), and whose last chunks' first tokens get their first
    drafts, so a request's first decode step already verifies drafts."""

    drafts = True

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
        inputs = cls.inputs_of(ctx, host, rows, update)
        return cls(
            inputs,
            inputs.is_sampled.astype(np.int64) + rows.num_drafts,
            cls.adapters_of(ctx, update, inputs),
        )

    def run_model_on_device(self, ctx: "StepContext") -> torch.Tensor:
        assert ctx.proposer is not None
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
        draws: "Draws | None",
    ) -> Sampled:
        assert ctx.proposer is not None
        sampled = super().sample_on_device(
            ctx, logits, metadata, needs_histories, grammar, draws
        )
        with torch.inference_mode():
            drafts = after_prompt_sampling(
                ctx.proposer,
                ctx.token_table,
                self.inputs.sample_slots,
                self.inputs.next_positions,
                sampled.tokens,
                self.inputs.layout.tables,
            )
        return replace(sampled, drafts=drafts)


SPECULATIVE_STEPS = StepKinds(
    ProposingPrefillStep,
    VerifyStep,
    None,
    "speculative decoding's verify step holds decode rows only; it needs a "
    "scheduler that never mixes them with prefill (the vllm_neuron_sched ones)",
)
