"""The compatibility matrix's engine-level half (README.md): what a user sets
for the whole engine (the model's kind, the scheduling mode with or without
speculative decoding, the logprobs mode), every pair of two settings on some
engine (a pairwise covering design), each against stock vLLM CPU with the
same model and logprobs mode. The per-request half is in test_generate.py.

The engines run in this process (``in_process_llm``: seconds to start) and
so does each stock engine, one after the other in one child process. Every
engine keeps vLLM's defaults, the prefix cache on: the prompts run twice,
the second time from prefix-cache hits (the shared prompts' 64k + 1 rests
included), across prefill chunks of 32 tokens.
"""

import json
from pathlib import Path
from typing import Any

import pytest
from allpairspy import AllPairs

from vllm_neuron_sched.testing.checkpoint import CheckpointSpec, make_checkpoint
from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    embed,
    generate,
    start_each_in_subprocess,
)
from vllm_neuron_sched.testing.workloads import (
    MODES,
    SMALL_ENGINE,
    STOCK_ENV,
    mixed_prompts,
)

pytestmark = pytest.mark.slow

# Model kinds beside the dense Llama: every other layer attends to the last
# 32 tokens (a sliding-window KV cache group beside the full one, as Gemma's),
# or a mixture of four experts (Mixtral).
MODELS: dict[str, CheckpointSpec | None] = {
    "dense": None,
    "sliding_window": CheckpointSpec(sliding_window=32),
    "moe": CheckpointSpec(num_experts=4),
}
LOGPROBS_MODES = [
    "raw_logprobs",
    "processed_logprobs",
    "raw_logits",
    "processed_logits",
]
ENGINES = [tuple(row) for row in AllPairs([list(MODELS), list(MODES), LOGPROBS_MODES])]
ROUNDS = 2
TOLERANCE = 1e-4


def _params() -> list[dict[str, Any]]:
    """Greedy, logprobs everywhere, prompt logprobs on two."""
    params = [
        {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, "logprobs": 3}
        for _ in mixed_prompts()
    ]
    params[1]["prompt_logprobs"] = params[4]["prompt_logprobs"] = 2
    return params


@pytest.fixture(scope="module")
def models(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    paths = {}
    for name, spec in MODELS.items():
        if spec is None:
            paths[name] = checkpoint_dir
        else:
            paths[name] = str(make_checkpoint(tmp_path_factory.mktemp(name), spec))
    return paths


def _stock_runs(models: dict[str, str]) -> list[dict[str, Any]]:
    """Stock (sync; no speculation) per model and logprobs mode the engines
    pair."""
    pairs = sorted({(model, mode) for model, _, mode in ENGINES})
    return [
        {
            "model": models[model],
            "prompts": mixed_prompts(),
            "sampling": _params(),
            "engine_kwargs": {**SMALL_ENGINE, "logprobs_mode": logprobs_mode},
            "rounds": ROUNDS,
            "pair": [model, logprobs_mode],
        }
        for model, logprobs_mode in pairs
    ]


@pytest.fixture(scope="module")
def stock(models: dict[str, str]) -> Any:
    """Starts with the module and runs while our engines do."""
    runs = _stock_runs(models)
    child = start_each_in_subprocess(runs, env=STOCK_ENV)

    def of(model: str, logprobs_mode: str) -> list[dict[str, Any]]:
        pairs = [run["pair"] for run in runs]
        return child.result()[pairs.index([model, logprobs_mode])]

    return of


@pytest.mark.parametrize(
    ("model", "mode", "logprobs_mode"), ENGINES, ids=["-".join(e) for e in ENGINES]
)
def test_engine_settings_in_pairs_equal_stock(
    models: dict[str, str], stock: Any, model: str, mode: str, logprobs_mode: str
) -> None:
    engine = {**SMALL_ENGINE, **MODES[mode], "logprobs_mode": logprobs_mode}
    with in_process_llm(models[model], **engine) as llm:
        ours = [
            record
            for _ in range(ROUNDS)
            for record in generate(llm, mixed_prompts(), _params())
        ]
    theirs = stock(model, logprobs_mode)
    for i, (record, expected) in enumerate(zip(ours, theirs, strict=True)):
        assert record["token_ids"] == expected["token_ids"], i
        assert_logprobs_close(record["logprobs"], expected["logprobs"], TOLERANCE)
        assert_logprobs_close(
            record["prompt_logprobs"], expected["prompt_logprobs"], TOLERANCE
        )


def test_models_are_what_they_say(models: dict[str, str]) -> None:
    """The sliding-window model has two KV cache groups' worth of layer
    kinds; the MoE model has experts."""
    configs = {
        name: json.loads((Path(path) / "config.json").read_text())
        for name, path in models.items()
    }
    assert set(configs["sliding_window"]["layer_types"]) == {
        "sliding_attention",
        "full_attention",
    }
    assert configs["moe"]["num_local_experts"] == 4
    assert "layer_types" not in configs["dense"] or set(
        configs["dense"]["layer_types"]
    ) == {"full_attention"}


# Pooling: our static-batch scheduler over vLLM's runner; async scheduling
# stays off when asked for (a pooling step has no token to run ahead on), as
# in stock vLLM.
POOLING_ENGINE = {**SMALL_ENGINE, "runner": "pooling", "max_num_batched_tokens": 256}


def test_pooling_embeddings_equal_stock(checkpoint_dir: str) -> None:
    prompts = mixed_prompts()
    run = {
        "model": checkpoint_dir,
        "prompts": prompts,
        "sampling": None,
        "engine_kwargs": POOLING_ENGINE,
        "rounds": ROUNDS,
    }
    stock = start_each_in_subprocess([run], env=STOCK_ENV)
    for async_scheduling in (False, True):
        engine = {**POOLING_ENGINE, "async_scheduling": async_scheduling}
        with in_process_llm(checkpoint_dir, **engine) as llm:
            config = llm.llm_engine.vllm_config.scheduler_config
            assert config.scheduler_cls.endswith("PoolingScheduler")
            assert not config.async_scheduling
            ours = [r for _ in range(ROUNDS) for r in embed(llm, prompts)]
        for record, expected in zip(ours, stock.result()[0], strict=True):
            assert record["embedding"] == pytest.approx(
                expected["embedding"], abs=TOLERANCE
            )
