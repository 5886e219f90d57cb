"""LoRA adapters (``--enable-lora``) against stock vLLM CPU: two adapters and
the base model in one batch, sync, async and async with n-gram or
draft-model speculation,
with ``max_loras=1`` (one
adapter's requests wait while the other's run, each adapter evicted and
loaded again), a prompt longer than a prefill chunk, a second round from
prefix-cache hits, logprobs and penalties; an adapter loaded and removed while the
engine serves, and through a TP=2 server; prompt logprobs refused
per request.

Stock runs with ``max_loras=3``: vLLM 0.32's CPU kernels give a token with no
adapter the last slot's adapter, so stock's base request is right only while
its last slot stays empty (docs/design.md section 15)."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.checkpoint import (
    ensure_trained_checkpoints,
    make_lora_adapter,
    repeat_prompt_ids,
)
from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    generate,
    spec_decode_counters,
    start_in_subprocess,
)
from vllm_neuron_sched.testing.server import (
    SERVED_MODEL,
    TEST_ENGINE_NICENESS,
    OpenAIServer,
    engine_args,
)
from vllm_neuron_sched.testing.workloads import MODES, SMALL_ENGINE, STOCK_ENV

pytestmark = pytest.mark.slow

ENGINE = {**SMALL_ENGINE, "enable_lora": True, "max_lora_rank": 8}
ROUNDS = 2  # the second from prefix-cache hits
# Penalties read each request's output so far (the device's histories).
PENALTIES = {
    "presence_penalty": 0.4,
    "frequency_penalty": 0.2,
    "repetition_penalty": 1.3,
}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint() -> str:
    """The trained checkpoint: its greedy output walks short cycles, which
    adapters this small bend but do not break, so drafts are accepted under
    them."""
    return str(ensure_trained_checkpoints()[0])


def _mode(name: str) -> dict[str, Any]:
    if name == "async_draft":  # the draft model runs without adapters
        draft = str(ensure_trained_checkpoints()[1])
        method = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        return {"async_scheduling": True, "speculative_config": method}
    return MODES[name]


@pytest.fixture(scope="module")
def adapters(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_lora_adapter(checkpoint, root / name, seed=seed, scale=0.1))
        for name, seed in (("a1", 1), ("a2", 2))
    }


@pytest.fixture(scope="module")
def prompts(checkpoint: str) -> list[list[int]]:
    return [
        repeat_prompt_ids(checkpoint, 0, length=41),  # two prefill chunks of 32
        repeat_prompt_ids(checkpoint, 1, length=15),
        repeat_prompt_ids(checkpoint, 2, length=16),
        repeat_prompt_ids(checkpoint, 3, length=14),
    ]


def _sampling(adapters: dict) -> list[dict[str, Any]]:
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    return [
        {**greedy, "logprobs": 2, "lora": ["a1", 1, adapters["a1"]]},
        # The base model, batched with the adapters, decoding on while the
        # second adapter's request waits for the slot and loads.
        {**greedy, "max_tokens": 40},
        {**greedy, "logprobs": 1, "lora": ["a2", 2, adapters["a2"]]},
        {**greedy, **PENALTIES, "lora": ["a1", 1, adapters["a1"]]},
    ]


@pytest.fixture(scope="module")
def stock(checkpoint: str, adapters: dict, prompts: list[list[int]]) -> Any:
    """Started ahead, in a child, while our engines start."""
    return start_in_subprocess(
        checkpoint,
        prompts,
        _sampling(adapters),
        {**ENGINE, "max_loras": 3},
        env={**os.environ, **STOCK_ENV},
        rounds=ROUNDS,
    )


@pytest.fixture(scope="module", params=["sync", "async", "async_ngram", "async_draft"])
def engine(request, checkpoint: str, stock: Any) -> Iterator[tuple[str, Any]]:
    """Ours: sync, async, async with n-gram or draft-model speculation (the
    verify step's queries take their row's adapter; greedy tokens are
    stock's without speculation)."""
    with in_process_llm(
        checkpoint,
        max_loras=1,
        disable_log_stats=False,  # vLLM's speculation counters
        **_mode(request.param),
        **ENGINE,
    ) as llm:
        yield request.param, llm


def test_adapters_and_the_base_model_in_one_batch_give_stocks_tokens(
    engine: tuple[str, Any], adapters: dict, stock: Any, prompts: list[list[int]]
) -> None:
    mode, llm = engine
    expected = stock.result()
    ours = [
        record
        for _ in range(ROUNDS)
        for record in generate(llm, prompts, _sampling(adapters))
    ]
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in expected]
    for our, theirs in zip(ours, expected):
        assert_logprobs_close(our["logprobs"], theirs["logprobs"], TOLERANCE)
    # The adapters changed the tokens: the same prompt without its adapter.
    base = generate(llm, prompts[:1], _sampling(adapters)[0] | {"lora": None})
    assert base[0]["token_ids"] != ours[0]["token_ids"]
    if mode.startswith("async_"):  # drafts were verified under the adapters
        assert spec_decode_counters(llm)["num_accepted_tokens"] > 0


def test_an_adapter_loaded_and_removed_while_serving(
    engine: tuple[str, Any], adapters: dict, stock: Any, prompts: list[list[int]]
) -> None:
    from vllm.lora.request import LoRARequest

    _, llm = engine
    engine_ = llm.llm_engine
    assert engine_.add_lora(LoRARequest("a2", 2, adapters["a2"]))
    assert 2 in engine_.list_loras()
    sampling = _sampling(adapters)[2]
    out = generate(llm, prompts[2:3], sampling)
    assert out[0]["token_ids"] == stock.result()[2]["token_ids"]
    assert engine_.remove_lora(2)
    assert 2 not in engine_.list_loras()
    # Loaded again on first use.
    assert generate(llm, prompts[2:3], sampling) == out


def test_prompt_logprobs_with_adapters_are_refused_and_the_engine_serves_on(
    engine: tuple[str, Any], adapters: dict, prompts: list[list[int]]
) -> None:
    _, llm = engine
    sampling = {**_sampling(adapters)[0], "prompt_logprobs": 1}
    with pytest.raises(ValueError, match="prompt_logprobs cannot be used with LoRA"):
        generate(llm, prompts[:1], sampling)
    served = generate(llm, prompts[:1], _sampling(adapters)[0])
    assert len(served[0]["token_ids"]) == 12


@pytest.mark.asyncio
async def test_the_server_serves_lora_modules_and_loads_adapters_at_runtime(
    checkpoint: str,
    adapters: dict,
    prompts: list[list[int]],
    stock: Any,
    tmp_path: Path,
) -> None:
    """``--lora-modules`` at start, ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` while serving (async, TP=2: vLLM's LoRA
    layers shard with the model, every rank activates the same mapping in
    the same step order), each adapter a model name of the API; stock's
    tokens."""
    import httpx
    import openai

    args = [
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a1={adapters['a1']}",
        "--async-scheduling",
        "--tensor-parallel-size",
        "2",
        *engine_args(SMALL_ENGINE),
    ]
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(2),
    }
    expected = stock.result()
    log = tmp_path / "server.log"
    with OpenAIServer.start(
        checkpoint, args, log, env, 300, TEST_ENGINE_NICENESS
    ) as server:
        client = server.client()

        async def tokens(model: str, prompt: list[int]) -> list[int]:
            out = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=12,
                temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            return list(out.choices[0].token_ids or [])

        assert "a1" in {m.id for m in (await client.models.list()).data}
        assert await tokens("a1", prompts[0]) == expected[0]["token_ids"]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            adapter = {"lora_name": "a2", "lora_path": adapters["a2"]}
            loaded = await http.post("/v1/load_lora_adapter", json=adapter)
            assert loaded.status_code == 200, loaded.text
            assert await tokens("a2", prompts[2]) == expected[2]["token_ids"]
            unloaded = await http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "a2"}
            )
            assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            await tokens("a2", prompts[2])
        assert await tokens(SERVED_MODEL, prompts[1]) == expected[1]["token_ids"][:12]


def test_the_adapter_file_is_peft_format(adapters: dict) -> None:
    for path in adapters.values():
        assert {p.name for p in Path(path).iterdir()} == {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
