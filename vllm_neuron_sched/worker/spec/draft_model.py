"""A draft model on the device: the proposer of ``"method": "draft_model"``.

The draft is a smaller model of the target's vocabulary, loaded beside it on
the same device and TP ranks. Its attention layers are in the KV cache spec
like the target's, so a request's blocks hold its draft KV too (``kv_cache``),
and everything stays on the device across steps, as for the n-gram proposer:

- every prefill chunk's forward is followed by the draft's forward over the
  same tokens, at the same padded shape (it writes the draft KV of the prompt);
- every sampling execution that adds tokens to a history (a prompt's first
  token, a verify step's accepted run) then runs the draft over exactly those
  tokens, at ``[decode bucket, W]`` (``W``: 1, or ``1 + K`` after a verify
  step), whose last real query gives draft 1, and ``K - 1`` more forwards at
  ``[decode bucket, 1]`` give drafts 2 to K, each fed the one before.

The drafts are the draft's greedy choices: a deterministic proposal, so
``rejection_sample`` (which treats drafts as one-hot proposals) keeps the
target's distribution. A draft's KV for tokens that get rejected is written
again by the ingest of what was accepted at those positions before any
query reads it, so the draft's cache never needs a repair. Its KV positions
run up to ``K - 1`` past the verify step's last query: vLLM's scheduler
allocates that lookahead for draft models (``num_lookahead_tokens``).
"""

from typing import TYPE_CHECKING, Any

import torch
from vllm.compilation.backends import set_model_tag
from vllm.config.utils import replace
from vllm.model_executor.model_loader import get_model

from vllm_neuron_sched.worker.device_forward import run_model
from vllm_neuron_sched.worker.kv_cache import DRAFT_PREFIX
from vllm_neuron_sched.worker.layout import Sequences, rectangle
from vllm_neuron_sched.worker.programs import EAGER, Programs
from vllm_neuron_sched.worker.spec.config import Speculation
from vllm_neuron_sched.worker.spec.proposer import AcceptedTokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_neuron_sched.worker.buckets import Buckets
    from vllm_neuron_sched.worker.inputs import StepInputs
    from vllm_neuron_sched.worker.token_table import DeviceTokens


class DraftModel:
    """The draft model and its attention groups; ``propose`` and
    ``prefill`` run inside device executions only."""

    def __init__(
        self, vllm_config: "VllmConfig", speculation: Speculation, buckets: "Buckets"
    ) -> None:
        self.vllm_config = vllm_config
        self.speculation = speculation
        self.num_tokens = speculation.num_tokens
        self.buckets = buckets
        self.model: Any = None
        self.groups: list[AttentionGroup] = []
        # Compiled per declared shape on the compiled device (the runner's).
        self.programs: Programs = EAGER

    def load(self) -> None:
        """The draft with its own model config and parallel layout, registered
        under ``DRAFT_PREFIX`` beside the target's layers (as vLLM's GPU draft
        proposer loads it)."""
        config = self.vllm_config.speculative_config
        assert config is not None
        draft_config = replace(
            self.vllm_config,
            quant_config=None,
            parallel_config=replace(
                config.draft_parallel_config,
                rank=self.vllm_config.parallel_config.rank,
            ),
            model_config=config.draft_model_config,
        )
        with set_model_tag(DRAFT_PREFIX):
            self.model = get_model(vllm_config=draft_config, prefix=DRAFT_PREFIX)

    def bind(self, groups: "list[AttentionGroup]") -> None:
        """The draft layers' attention groups, once the KV cache exists."""
        if not groups:
            raise ValueError("the draft model has no attention layers with a KV cache")
        self.groups = groups

    # ---- device side ---------------------------------------------------------

    def prefill(self, inputs: "StepInputs") -> None:
        """The draft over a prefill step's tokens, with the target's attention
        inputs (same blocks, same KV slots)."""
        layout = inputs.layout
        commons = {g.kv_cache_group_id: common for g, common in layout.attn_inputs}
        draft_inputs = [(g, commons[g.kv_cache_group_id]) for g in self.groups]
        slot_mapping = {
            name: common.slot_mapping
            for group, common in draft_inputs
            for name in group.layer_names
        }
        self._run(
            inputs.input_ids,
            layout.positions,
            draft_inputs,
            slot_mapping,
            layout.num_tokens_padded,
        )

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_inputs: "list[tuple[AttentionGroup, CommonAttentionMetadata]]",
        slot_mapping: dict[str, torch.Tensor],
        num_tokens_padded: int,
    ) -> torch.Tensor:
        return run_model(
            self.model,
            self.vllm_config,
            input_ids,
            positions,
            attn_inputs,
            slot_mapping,
            num_tokens_padded,
        )

    def propose(self, tokens: "DeviceTokens", accepted: AcceptedTokens) -> None:
        """K greedy drafts per row: the ingest of what the row just added,
        then K - 1 single-query forwards (module docstring)."""
        rows, width = accepted.tokens.shape
        num_rows = self.buckets.pad_decode(rows)
        counts = accepted.counts

        def queries(width: int, starts: torch.Tensor, real: torch.Tensor) -> Sequences:
            """Every position is below the token table's width (the bound)."""
            return rectangle(
                num_rows,
                width,
                starts,
                real,
                accepted.tables,
                tokens.history_len,
                self.programs.rectangle_queries,
            )

        # The ingest: the tokens just added, their last real query's logits.
        ids = torch.zeros((num_rows, width), dtype=torch.int32)
        ids[:rows] = accepted.tokens.clamp(min=0)
        ingest = queries(width, accepted.starts, counts)
        last = torch.arange(rows) * width + (counts - 1).clamp(min=0)
        drafts = [self._greedy(ids, ingest, last)]
        # Drafts 2..K, each fed the one before, one query per row.
        known = accepted.starts + counts  # tokens known after the ingest
        real_rows = counts > 0
        real = torch.arange(rows)
        for k in range(1, self.num_tokens):
            position = known - 1 + k
            ids = torch.zeros((num_rows, 1), dtype=torch.int32)
            ids[:rows, 0] = drafts[-1]
            is_real = real_rows & (position < self.speculation.max_model_len)
            step = queries(1, position, is_real.long())
            drafts.append(self._greedy(ids, step, real))
        # As many drafts as fit before max_model_len (the n-gram rule).
        limit = (self.speculation.max_model_len - known).clamp(
            min=0, max=self.num_tokens
        )
        tokens.set_drafts(
            accepted.slots,
            torch.stack(drafts, dim=1),
            torch.where(real_rows, limit, 0),
        )

    def _greedy(
        self, ids: torch.Tensor, sequences: Sequences, select: torch.Tensor
    ) -> torch.Tensor:
        """The draft's greedy token after each ``select``-ed query of a
        ``[rows, width]`` step (indices into its flattened queries)."""
        hidden_states = self._run(
            ids.flatten(),
            sequences.model_positions(self.speculation.max_model_len),
            *sequences.attention(self.groups),
            ids.numel(),
        )
        logits = self.programs.compute_logits(hidden_states[select], self.model)
        return logits.argmax(dim=-1)
