"""What a user can turn on in vLLM that this plugin's runner does not run.

Our model runner (``worker/``) takes the place of vLLM's. A feature that
lives in the engine, the scheduler or the front end works as in stock vLLM; a
feature that lives in vLLM's runner is either done again here or refused
here, with the option's name and what to do instead, so that it is never
silently ignored. Start-up options are checked in the front end before any
process starts (``check_config``); per-request options at the API and in the
engine (``request_error``). docs/design.md section 10 has the whole list;
README.md's compatibility matrix names the test of each.

Pooling models run vLLM's own runner (``NeuronSchedWorker``), and so does a
user's ``--worker-cls``: nothing here applies to them.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# For everything refused: vLLM's own CPU platform in the same environment.
STOCK = "stock vLLM CPU (VLLM_NEURON_SCHED_DISABLE=1)"


@dataclass(frozen=True)
class Unsupported:
    option: str  # as the user turns it on
    is_on: Callable[["VllmConfig"], bool]
    instead: str  # what to do instead


def _model(check: Callable[[Any], bool]) -> Callable[["VllmConfig"], bool]:
    return lambda config: check(config.model_config)


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(
        "LoRA adapters with pipeline parallel (--enable-lora with "
        "--pipeline-parallel-size > 1)",
        lambda c: (
            c.lora_config is not None and c.parallel_config.pipeline_parallel_size > 1
        ),
        "serve adapters with --tensor-parallel-size",
    ),
    Unsupported(
        "multimodal inputs (a vision/audio model)",
        _model(lambda m: m.supports_multimodal_inputs or m.uses_mrope),
        f"use a text-only model, or {STOCK}",
    ),
    Unsupported(
        "encoder-decoder models",
        _model(lambda m: m.is_encoder_decoder),
        f"use a decoder-only model, or {STOCK}",
    ),
    Unsupported(
        "prompt embeddings (--enable-prompt-embeds)",
        _model(lambda m: m.enable_prompt_embeds),
        f"send token ids or text, or use {STOCK}",
    ),
    Unsupported(
        "MLA attention models (DeepSeek-V2/V3 style)",
        _model(lambda m: m.use_mla),
        f"use {STOCK}",
    ),
    Unsupported(
        "state-space and hybrid models (Mamba layers, no attention KV cache)",
        _model(lambda m: m.is_hybrid or m.has_inner_state or m.is_attention_free),
        f"use a transformer model, or {STOCK}",
    ),
    Unsupported(
        "diffusion language models",
        _model(lambda m: m.is_diffusion),
        f"use {STOCK}",
    ),
    Unsupported(
        "speculative decoding with pipeline parallel (--speculative-config with "
        "--pipeline-parallel-size > 1)",
        lambda c: (
            c.parallel_config.pipeline_parallel_size > 1
            and c.speculative_config is not None
        ),
        "speculate with --tensor-parallel-size, or leave out --speculative-config",
    ),
    Unsupported(
        "custom logits processors with speculative decoding (--logits-processors "
        "with --speculative-config; vLLM refuses them too, when its runner starts)",
        lambda c: (
            c.speculative_config is not None and bool(c.model_config.logits_processors)
        ),
        "leave out one of the two",
    ),
    Unsupported(
        "context parallel (--decode-context-parallel-size or "
        "--prefill-context-parallel-size > 1)",
        lambda c: (
            c.parallel_config.decode_context_parallel_size > 1
            or c.parallel_config.prefill_context_parallel_size > 1
        ),
        "use --tensor-parallel-size",
    ),
    Unsupported(
        "mixture-of-experts models with data parallel (--data-parallel-size > 1)",
        lambda c: c.model_config.is_moe and c.parallel_config.data_parallel_size > 1,
        "use --tensor-parallel-size for a MoE model",
    ),
    Unsupported(
        "KV cache transfer and offloading (--kv-transfer-config, --kv-offloading-size)",
        lambda c: (
            c.kv_transfer_config is not None
            or c.cache_config.kv_offloading_size is not None
        ),
        f"keep the KV cache in the engine, or use {STOCK}",
    ),
    Unsupported(
        "encoder cache transfer (--ec-transfer-config)",
        lambda c: c.ec_transfer_config is not None,
        f"use {STOCK}",
    ),
    Unsupported(
        "weight transfer from a trainer (--weight-transfer-config)",
        lambda c: getattr(c, "weight_transfer_config", None) is not None,
        "load new weights with collective_rpc('reload_weights', kwargs="
        "{'weights_path': ...}), which runs in the device's order",
    ),
    Unsupported(
        "fault tolerance (--enable-fault-tolerance)",
        lambda c: bool(getattr(c.parallel_config, "enable_fault_tolerance", False)),
        f"leave it out, or use {STOCK}",
    ),
    Unsupported(
        "vLLM's model runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, --watermark-config, "
        "HiSparse attention)",
        lambda c: c.use_v2_model_runner,
        "set VLLM_USE_V2_MODEL_RUNNER=0 and leave out the options that need V2",
    ),
)


def check_config(vllm_config: "VllmConfig") -> None:
    """Refuses, in one message, every option of this configuration that our
    runner does not run."""
    refused = [u for u in UNSUPPORTED if u.is_on(vllm_config)]
    if refused:
        raise ValueError(
            "vllm_neuron_sched does not run "
            + "; ".join(f"{u.option}: {u.instead}" for u in refused)
        )


def request_error(params: object) -> str | None:
    """Why a request's parameters cannot run here, or None."""
    if getattr(params, "thinking_token_budget", None) is not None:
        return (
            "thinking_token_budget is not supported by vllm_neuron_sched: leave "
            f"it out (the reasoning parser works), or use {STOCK}"
        )
    return None
