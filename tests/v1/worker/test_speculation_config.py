"""Start-up checks of ``--speculative-config`` (no engine: vLLM's config
with this platform's check)."""

from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_neuron_sched.core.limits import RequestLimits
from vllm_neuron_sched.platform import ASYNC_CHUNKED_PREFILL_SCHEDULER
from vllm_neuron_sched.testing.checkpoint import ensure_trained_checkpoints
from vllm_neuron_sched.worker.spec.config import Speculation

K = 3


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    target, draft = ensure_trained_checkpoints()
    return str(target), str(draft)


def _config(target: str, speculative: dict[str, Any], **engine: Any) -> Any:
    return EngineArgs(
        model=target,
        max_model_len=256,
        scheduler_cls=ASYNC_CHUNKED_PREFILL_SCHEDULER,
        speculative_config={"num_speculative_tokens": K, **speculative},
        **engine,
    ).create_engine_config()


def test_draft_model_reserves_its_lookahead(checkpoints: tuple[str, str]) -> None:
    """Async scheduling stays on; admission reserves the verify step's K, the
    unretired step's K, and the draft's K KV positions past the verify."""
    target, draft = checkpoints
    config = _config(target, {"method": "draft_model", "model": draft})
    assert config.scheduler_config.async_scheduling
    speculation = Speculation.from_config(config)
    assert speculation is not None
    assert (speculation.method, speculation.num_tokens) == ("draft_model", K)
    assert RequestLimits.from_config(config).spec_lookahead == 3 * K


def test_draft_on_other_tp_ranks_is_refused(checkpoints: tuple[str, str]) -> None:
    """A draft with one rank under a target with two (vLLM allows 1 or the
    target's): its forwards would run on rank 0 alone."""
    target, draft = checkpoints
    speculative = {"method": "draft_model", "model": draft}
    config = _config(target, speculative)
    # The target's TP=2 set after the config check, which would also ask
    # this machine for two workers' thread binding.
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="'draft_tensor_parallel_size' must be 2"):
        Speculation.from_config(config)


def test_a_scheduler_that_mixes_is_refused(checkpoints: tuple[str, str]) -> None:
    """vLLM's own scheduler mixes prefill and decode rows in a step."""
    target, draft = checkpoints
    with pytest.raises(ValueError, match="chunked-prefill schedulers"):
        EngineArgs(
            model=target,
            max_model_len=256,
            scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler",
            speculative_config={
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": K,
            },
        ).create_engine_config()


def test_sampling_the_verify_step_cannot_run_is_refused(
    checkpoints: tuple[str, str],
) -> None:
    """Per request, before it reaches the engine: min_p (vLLM itself refuses
    it with speculation); structured outputs and logprobs in every logprobs
    mode run."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    target, _ = checkpoints
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    structured = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), logprobs=2
    )
    for mode in ("raw_logprobs", "processed_logits"):
        limits = RequestLimits.from_config(_config(target, ngram, logprobs_mode=mode))
        assert limits.check_sampling(structured) is None
    reason = limits.check_sampling(SamplingParams(min_p=0.1))
    assert reason is not None and reason.startswith("min_p cannot be used")
