"""Static-shape limits a request must fit, checked where it enters.

Shared by the platform (front end: a bad request gets a clear 400) and the
schedulers (a request that reached the engine anyway is finished with an error
instead of waiting forever). Pure policy: no tensors, no threads.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_neuron_sched import envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True, order=True)
class PoolingShape:
    """One compiled pooling graph: prompts up to ``prompt_len``, ``batch_size`` rows."""

    prompt_len: int
    batch_size: int


def parse_pooling_shapes(
    spec: str, max_model_len: int, max_num_seqs: int
) -> tuple[PoolingShape, ...]:
    """Parse ``"64x8,256x2"``; empty means one shape, the model's limits."""
    if not spec.strip():
        return (PoolingShape(max_model_len, max_num_seqs),)
    shapes = []
    for item in spec.split(","):
        try:
            prompt_len, batch_size = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(
                f"VLLM_NEURON_SCHED_POOLING_SHAPES: {item!r} is not "
                "PROMPT_LENxBATCH (e.g. '64x8,256x2')"
            ) from None
        if prompt_len <= 0 or batch_size <= 0 or prompt_len > max_model_len:
            raise ValueError(
                f"VLLM_NEURON_SCHED_POOLING_SHAPES: shape {item!r} needs "
                f"0 < prompt_len <= max_model_len ({max_model_len}) and batch > 0"
            )
        shapes.append(PoolingShape(prompt_len, batch_size))
    return tuple(sorted(shapes))


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    # Decode batch size * worst-case tkv must stay under this.
    max_batch_tkv_limit: int
    # Static pooling shapes; None for generation models.
    pooling_shapes: tuple[PoolingShape, ...] | None = None
    # Tokens one step may schedule; a pooling prompt is never chunked, so it
    # must fit one step. None: no cap.
    max_num_scheduled_tokens: int | None = None
    # The engine speculates: sampling options its verify step does not run
    # yet are refused (``check_sampling``).
    speculates: bool = False
    # Positions a speculating request may reach past prompt + max_tokens: a
    # verify step's drafts, with async scheduling the drafts of the step
    # before, whose rejections the scheduler has not heard of yet, and a draft
    # model's KV past the verify step (vLLM's ``num_lookahead_tokens``).
    spec_lookahead: int = 0
    # LoRA adapters are on (--enable-lora): the LM head's LoRA layer takes one
    # logits row per request, so prompt logprobs are refused.
    lora: bool = False
    # The compiled device lays a step's bad words out at one declared shape:
    # at most this many tokens per request (vLLM's
    # VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, which its GPU runner holds too).
    # None: any.
    max_bad_words_tokens: int | None = None

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig") -> "RequestLimits":
        max_model_len = vllm_config.model_config.max_model_len
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        tkv_limit = envs.VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT
        if tkv_limit <= 0:
            tkv_limit = max_num_seqs * max_model_len
        shapes = None
        if vllm_config.model_config.runner_type == "pooling":
            shapes = parse_pooling_shapes(
                envs.VLLM_NEURON_SCHED_POOLING_SHAPES, max_model_len, max_num_seqs
            )
        scheduler_config = vllm_config.scheduler_config
        max_num_scheduled_tokens = (
            scheduler_config.max_num_scheduled_tokens
            or scheduler_config.max_num_batched_tokens
        )
        depth = 2 if scheduler_config.async_scheduling else 1
        max_bad_words_tokens = None
        if envs.VLLM_NEURON_SCHED_DEVICE == "compiled":
            from vllm import envs as vllm_envs

            max_bad_words_tokens = vllm_envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS
        return cls(
            max_model_len,
            tkv_limit,
            shapes,
            max_num_scheduled_tokens,
            speculates=vllm_config.speculative_config is not None,
            spec_lookahead=depth * vllm_config.num_speculative_tokens
            + vllm_config.num_lookahead_tokens,
            lora=vllm_config.lora_config is not None,
            max_bad_words_tokens=max_bad_words_tokens,
        )

    def check_sampling(self, params: object) -> str | None:
        """Why these sampling parameters cannot run on this engine, or None.

        With speculative decoding the verify step samples greedy, temperature,
        top-k, top-p, seeds, penalties, allowed tokens, min_tokens, bad words
        and structured outputs (``speculation.rejection_sample``,
        ``constrain_verify_logits``, ``plan_grammar``) and reports logprobs in
        every logprobs mode (``verify_logprobs``). Logit bias and min_p, which
        vLLM itself refuses with speculative decoding, are refused rather than
        run wrong."""
        if error := self._check_bad_words(params):
            return error
        if self.lora and getattr(params, "prompt_logprobs", None) is not None:
            # vLLM 0.32's own CPU runner fails the engine on it.
            return (
                "prompt_logprobs cannot be used with LoRA adapters (--enable-lora) "
                "on vllm_neuron_sched: the LM head's LoRA layer computes one "
                "logits row per request; leave it out, or serve without "
                "--enable-lora"
            )
        if not self.speculates:
            return None
        unsupported = [
            name
            for name, is_set in (
                ("logit_bias", getattr(params, "logit_bias", None)),
                ("min_p", getattr(params, "min_p", 0.0)),
            )
            if is_set
        ]
        if not unsupported:
            return None
        return (
            f"{', '.join(unsupported)} cannot be used with speculative decoding "
            "on vllm_neuron_sched (temperature, top_k, top_p, seed, penalties, "
            "allowed_token_ids, min_tokens, bad_words, structured_outputs, "
            "logprobs and prompt_logprobs can)"
        )

    def _check_bad_words(self, params: object) -> str | None:
        """Tokenized bad words (the engine sees them so; the front end still
        holds the text) beyond the compiled device's declared shape."""
        limit = self.max_bad_words_tokens
        words = getattr(params, "bad_words_token_ids", None) or ()
        num_tokens = sum(map(len, words))
        if limit is None or num_tokens <= limit:
            return None
        return (
            f"bad_words tokenize to {num_tokens} tokens, more than the "
            f"{limit} per request the compiled device's bad-words program "
            "is compiled for (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, vLLM's own "
            "limit); use fewer bad words, or raise it before the server starts"
        )

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> str | None:
        """Why a request can never run, or None if some batch can take it."""
        if self.pooling_shapes is not None:
            longest = self.pooling_shapes[-1].prompt_len
            if num_prompt_tokens > longest:
                return (
                    f"prompt has {num_prompt_tokens} tokens but the longest "
                    f"static pooling shape takes {longest} "
                    "(VLLM_NEURON_SCHED_POOLING_SHAPES)"
                )
            budget = self.max_num_scheduled_tokens
            if budget is not None and num_prompt_tokens > budget:
                return (
                    f"prompt has {num_prompt_tokens} tokens but a pooling step "
                    f"takes at most {budget} (max_num_batched_tokens); pooling "
                    "prompts are not chunked"
                )
            return None
        volume = num_prompt_tokens + (max_tokens or 1) + self.spec_lookahead
        if volume > self.max_batch_tkv_limit:
            drafts = (
                f" + draft lookahead ({self.spec_lookahead})"
                if self.spec_lookahead
                else ""
            )
            return (
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})"
                f"{drafts} = {volume} exceeds the decode batch tkv limit "
                f"{self.max_batch_tkv_limit} "
                "(VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT)"
            )
        return None

    def fits_pooling_shape(self, num_prompt_tokens: int, batch_size: int) -> bool:
        return any(
            num_prompt_tokens <= s.prompt_len and batch_size <= s.batch_size
            for s in self.pooling_shapes or ()
        )
