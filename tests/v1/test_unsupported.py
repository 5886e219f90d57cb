"""What our runner does not run is refused with the option's name, at
start-up (vLLM's config with this platform's check: no engine) or per
request, never silently ignored (``vllm_neuron_sched/unsupported.py``)."""

import json
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams

from vllm_neuron_sched.platform import NeuronSchedPlatform
from vllm_neuron_sched.testing.checkpoint import ensure_trained_checkpoints
from vllm_neuron_sched.testing.logits_processors import COUNTING_STOP
from vllm_neuron_sched.testing.scheduler_loop import build_scheduler, make_request

# Model configs of the architectures refused (config.json only: enough for
# vLLM's config, which is all a start-up check builds).
_LAYERS = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}
MODELS: dict[str, dict[str, Any]] = {
    "mla": {
        **_LAYERS,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "moe_intermediate_size": 64,
    },
    "mamba": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "state_size": 16,
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "torch_dtype": "float32",
    },
    "encoder_decoder": {
        "vocab_size": 1024,
        "d_model": 64,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_position_embeddings": 512,
        "architectures": ["BartForConditionalGeneration"],
        "model_type": "bart",
        "torch_dtype": "float32",
    },
    "moe": {
        **_LAYERS,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = {}
    for name, config in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    target, draft = ensure_trained_checkpoints()
    return str(target), str(draft)


def _refusal(model: str, **engine: Any) -> str:
    with pytest.raises(ValueError) as refused:
        EngineArgs(model=model, max_model_len=256, **engine).create_engine_config()
    return str(refused.value)


@pytest.mark.parametrize(
    ("engine", "option"),
    [
        (
            {"enable_lora": True, "max_lora_rank": 8, "pipeline_parallel_size": 2},
            "LoRA adapters with pipeline parallel",
        ),
        ({"enable_prompt_embeds": True}, "prompt embeddings (--enable-prompt-embeds)"),
        (
            {
                "pipeline_parallel_size": 2,
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3,
                },
            },
            "speculative decoding with pipeline parallel",
        ),
        (
            {
                "logits_processors": [COUNTING_STOP],
                "speculative_config": {
                    "method": "ngram_gpu",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3,
                },
            },
            "custom logits processors with speculative decoding",
        ),
        ({"weight_transfer_config": {"backend": "nccl"}}, "--weight-transfer-config"),
        ({"kv_offloading_size": 1.0}, "--kv-offloading-size"),
        (
            {
                "kv_transfer_config": {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                }
            },
            "--kv-transfer-config",
        ),
    ],
)
def test_engine_options_our_runner_does_not_run_are_refused(
    checkpoints: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    engine: dict[str, Any],
    option: str,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # two PP ranks
    message = _refusal(checkpoints[0], **engine)
    assert "vllm_neuron_sched does not run" in message
    assert option in message
    assert (
        "VLLM_NEURON_SCHED_DISABLE=1" in message
        or "tensor-parallel" in message
        or "leave out one" in message
        or "reload_weights" in message
    )


def test_model_runner_v2_is_refused(
    checkpoints: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    message = _refusal(checkpoints[0])
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in message


@pytest.mark.parametrize(
    ("model", "engine", "option"),
    [
        ("mla", {}, "MLA attention models"),
        ("mamba", {}, "state-space and hybrid models"),
        ("encoder_decoder", {}, "encoder-decoder models"),
        ("moe", {"data_parallel_size": 2}, "mixture-of-experts models with data"),
    ],
)
def test_model_kinds_our_runner_does_not_run_are_refused(
    model_dirs: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    engine: dict[str, Any],
    option: str,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # two DP replicas
    message = _refusal(model_dirs[model], skip_tokenizer_init=True, **engine)
    assert option in message


def test_pooling_models_keep_what_vllms_runner_runs(
    checkpoints: tuple[str, str],
) -> None:
    """Pooling runs vLLM's own runner: LoRA is its to run."""
    config = EngineArgs(
        model=checkpoints[0],
        max_model_len=256,
        runner="pooling",
        enable_lora=True,
        max_lora_rank=8,
    ).create_engine_config()
    assert config.lora_config is not None


@pytest.mark.parametrize(
    ("speculative", "option"),
    [
        (
            {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2},
            "rejection_sample_method 'synthetic'",
        ),
        ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"parallel_drafting": True}, "parallel_drafting"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ],
)
def test_speculative_options_the_verify_step_does_not_run_are_refused(
    checkpoints: tuple[str, str], speculative: dict[str, Any], option: str
) -> None:
    target, draft = checkpoints
    config = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
        **speculative,
    }
    message = _refusal(target, speculative_config=config)
    assert option in message


def test_a_draft_shorter_than_the_model_is_refused(
    checkpoints: tuple[str, str],
) -> None:
    target, draft = checkpoints
    config = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
        "max_model_len": 128,
    }
    message = _refusal(target, speculative_config=config)
    assert "--max-model-len 128 or less" in message


def test_a_thinking_budget_is_refused_per_request() -> None:
    """At the API (and in the engine, for a request that reaches it there):
    the reasoning parser itself works."""
    with pytest.raises(ValueError, match="thinking_token_budget"):
        NeuronSchedPlatform.validate_request(
            {"type": "token", "prompt_token_ids": [1, 2, 3]},
            SamplingParams(thinking_token_budget=16),
        )


def test_a_streaming_input_session_finishes_with_an_error(
    checkpoint_dir: str,
) -> None:
    """A prompt fed from an async generator (a resumable request) reaches
    the engine only: our scheduler finishes it with an error."""
    from vllm_neuron_sched.core.scheduler import AsyncChunkedPrefillScheduler

    scheduler = build_scheduler(
        AsyncChunkedPrefillScheduler, checkpoint_dir, async_scheduling=True
    )
    request = make_request("session", 8, 4)
    request.resumable = True
    scheduler.add_request(request)
    assert request.is_finished()
    assert str(request.get_finished_reason()) == "error"


def test_multimodal_models_are_refused() -> None:
    """No vision or audio model loads in this environment (its image
    processors need the torchvision the set-up removes), so the check runs
    on the model config's answers."""
    from types import SimpleNamespace

    from vllm_neuron_sched.unsupported import check_config

    model = SimpleNamespace(
        supports_multimodal_inputs=True,
        uses_mrope=False,
        is_encoder_decoder=False,
        enable_prompt_embeds=False,
        use_mla=False,
        is_hybrid=False,
        has_inner_state=False,
        is_attention_free=False,
        is_diffusion=False,
        is_moe=False,
    )
    config = SimpleNamespace(
        model_config=model,
        lora_config=None,
        speculative_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            data_parallel_size=1,
        ),
        kv_transfer_config=None,
        cache_config=SimpleNamespace(kv_offloading_size=None),
        ec_transfer_config=None,
        use_v2_model_runner=False,
    )
    with pytest.raises(ValueError, match="multimodal inputs"):
        check_config(config)
    model.supports_multimodal_inputs = False
    check_config(config)  # a text model passes


def test_speculation_on_a_pooling_model_is_refused(
    checkpoints: tuple[str, str],
) -> None:
    target, _ = checkpoints
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    with pytest.raises(ValueError, match="chunked-prefill schedulers"):
        EngineArgs(
            model=target, max_model_len=256, runner="pooling", speculative_config=ngram
        ).create_engine_config()


def test_more_pipeline_stages_than_layers_are_refused(
    checkpoints: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    message = _refusal(checkpoints[0], pipeline_parallel_size=4)
    assert "--pipeline-parallel-size 4" in message
    assert "layers" in message


def test_pooling_with_pipeline_stages_is_refused(
    checkpoints: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    message = _refusal(checkpoints[0], runner="pooling", pipeline_parallel_size=2)
    assert "pooling models" in message
    assert "--pipeline-parallel-size" in message
