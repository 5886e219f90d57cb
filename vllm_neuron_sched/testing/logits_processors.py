"""Custom logits processors as a user plugs them in (``LLM(logits_processors=
[...])``, ``--logits-processors``), for the tests: one that reads the output
so far, one that keeps state across steps. Named by their import path, so a
stock engine in a child process loads the same classes.

Both are deterministic functions of what vLLM hands them, so any runner that
feeds them as vLLM does gives stock's tokens: the real output tokens before
each step's sampling, and one ``apply`` per step that samples.
"""

from collections.abc import Callable

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

# Request keywords that turn each processor on (``SamplingParams.extra_args``).
NEXT_TOKEN_ARG = "next_token_only"
COUNT_STOP_ARG = "stop_after_applies"

NEXT_TOKEN = f"{__name__}:NextTokenProcessor"
COUNTING_STOP = f"{__name__}:CountingStopProcessor"


class NextTokenProcessor(AdapterLogitsProcessor):
    """Per request (``extra_args={"next_token_only": True}``): after the first
    output token, only "the last output token + 1" is allowed. A runner that
    shows it a placeholder instead of the newest token gives other tokens."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(
        self, params: SamplingParams
    ) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        if not (params.extra_args or {}).get(NEXT_TOKEN_ARG):
            return None

        def only_next(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if not output_ids:
                return logits
            allowed = (output_ids[-1] + 1) % logits.shape[-1]
            kept = logits[allowed].clone()
            logits.fill_(float("-inf"))
            logits[allowed] = kept
            return logits

        return only_next


class CountingStopProcessor(LogitsProcessor):
    """Batch level, with state: counts, per request, the ``apply`` calls of
    the steps that held it; from the N-th on (``extra_args=
    {"stop_after_applies": N}``) it forces EOS on that request's row. A
    runner that applies a copy each step never reaches N.

    The count belongs to the request, not to its batch row: vLLM takes a
    request that a step does not schedule out of the batch and adds it back
    later (its ``BatchUpdate``), and so do we, between a decode step and the
    prefill steps of others. (A prompt that takes several steps is applied
    to in each in stock vLLM, and only in its last here, where its prompt
    chunks are sampled: tests give it a prompt of one step.)"""

    def __init__(
        self, vllm_config: object, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.rows: dict[int, list[int]] = {}  # batch row -> its request's count
        # The request's params (the same object when it comes back) -> its
        # [N, apply calls so far], kept while the request lives.
        self.counts: dict[int, tuple[SamplingParams, list[int]]] = {}
        config = getattr(vllm_config, "model_config", None)
        hf_config = getattr(config, "hf_config", None)
        self.eos = getattr(hf_config, "eos_token_id", None) or 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, _ in batch_update.added:
            self.rows.pop(index, None)
            n = (params.extra_args or {}).get(COUNT_STOP_ARG)
            if n:
                _, count = self.counts.setdefault(id(params), (params, [int(n), 0]))
                self.rows[index] = count
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if entry_a is not None:
                self.rows[b] = entry_a
            if entry_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = entry_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, count in self.rows.items():
            count[1] += 1
            if count[1] >= count[0]:
                logits[row].fill_(float("-inf"))
                logits[row, self.eos] = 0.0
        return logits
