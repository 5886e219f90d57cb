"""Speculative decoding's configuration: which methods this runner runs, and
the refusals of what it does not (checked at start-up, before any process)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# The proposers this runner runs on the device. "ngram_gpu" is vLLM's name for
# an n-gram proposer on the accelerator, the one vLLM's config check lets run
# with async scheduling; "ngram" is the same proposer for sync scheduling.
# "draft_model": a smaller model of the same vocabulary (sync and async).
NGRAM_METHODS = ("ngram", "ngram_gpu")


DRAFT_MODEL = "draft_model"


METHODS = (*NGRAM_METHODS, DRAFT_MODEL)


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
