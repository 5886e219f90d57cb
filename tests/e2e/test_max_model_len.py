"""``max_model_len=-1``: vLLM lowers the model's length to what the KV cache
holds once it is sized, after the front end has checked the configuration
and the workers have started. Everything reads that one value: the API
refuses what the lowered engine cannot run (a 400, not an error from inside
the engine), and a request that runs to the new end gets stock's tokens,
speculative decoding included (its drafts stop there)."""

from collections.abc import Iterator
from typing import Any

import pytest

from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import generate, start_each_in_subprocess
from vllm_neuron_sched.testing.workloads import MODES, STOCK_ENV, token_prompts

pytestmark = pytest.mark.slow

# 5 blocks of 32 tokens (one more is vLLM's null block): 160 positions of
# the checkpoint's 2048.
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": -1,
    "block_size": 32,
    "num_gpu_blocks_override": 6,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "seed": 0,
    "enforce_eager": True,
}
FITTED = 160
# A prompt that runs to the fitted end.
PROMPT = token_prompts([140])
TO_THE_END = {"temperature": 0.0, "max_tokens": FITTED - 140, "ignore_eos": True}


def _stock(checkpoint: str) -> Any:
    run = {
        "model": checkpoint,
        "prompts": PROMPT,
        "sampling": TO_THE_END,
        "engine_kwargs": ENGINE,
    }
    return start_each_in_subprocess([run], env=STOCK_ENV)


@pytest.fixture(scope="module", params=list(MODES))
def llm(request: pytest.FixtureRequest, checkpoint_dir: str) -> Iterator[Any]:
    _stock(checkpoint_dir)  # runs while our engines do
    with in_process_llm(checkpoint_dir, **ENGINE, **MODES[request.param]) as engine:
        yield engine


def test_the_fitted_length_is_everyones(llm: Any, checkpoint_dir: str) -> None:
    assert llm.llm_engine.model_config.max_model_len == FITTED
    ours = generate(llm, PROMPT, TO_THE_END)
    stock = _stock(checkpoint_dir).result()[0]
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in stock]
    assert len(ours[0]["token_ids"]) == FITTED - 140
    assert ours[0]["finish_reason"] == "length"


def test_the_api_refuses_what_the_fitted_engine_cannot_run(llm: Any) -> None:
    """Ten prompt tokens and 5,000 new ones pass the configured 2,048
    positions' batch limit (4 x 2,048) but not the fitted one (4 x 160), nor
    that of any other engine the test process may hold (16 x 256 at most)."""
    with pytest.raises(ValueError, match="tkv limit"):
        generate(llm, token_prompts([10]), {"max_tokens": 5000})
    # The engine serves on.
    again = generate(llm, token_prompts([10]), {"temperature": 0.0, "max_tokens": 4})
    assert len(again[0]["token_ids"]) == 4
