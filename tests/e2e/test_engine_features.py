"""The compatibility matrix's engine-level half (README.md): what a user sets
for the whole engine (the model's kind, the scheduling mode with or without
speculative decoding, the logprobs mode, the dtype, the device backend
(inline, threaded, compiled per shape), the user's logits processors), every
pair of two settings on some engine (a pairwise covering design), each
against stock vLLM CPU with the same model,
logprobs mode, dtype and processors. The per-request half is in
test_generate.py.

The engines run in this process (``in_process_llm``: seconds to start) and
so does each stock engine, one after the other in one child process. Every
engine keeps vLLM's defaults, the prefix cache on: the prompts run twice,
the second time from prefix-cache hits (the shared prompts' 64k + 1 rests
included), across prefill chunks of 32 tokens. Beside the greedy requests,
``min_tokens`` meets stops it can reach (no ``ignore_eos``), alone and under
a grammar whose end leaves nothing but EOS; with processors, one request
reads its output so far and one is stopped by a processor that keeps state
from step to step. float32 tokens equal stock's; bfloat16 ones may part
from stock only where stock itself is within its noise floor
(``assert_within_bf16_floor``).
"""

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from vllm_neuron_sched.testing import logits_processors as lp
from vllm_neuron_sched.testing.checkpoint import CheckpointSpec, make_checkpoint
from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    assert_within_bf16_floor,
    embed,
    generate,
    start_each_in_subprocess,
)
from vllm_neuron_sched.testing.pairwise import covering_rows
from vllm_neuron_sched.testing.workloads import (
    BF16_LOGPROB_FLOOR,
    MODES,
    SMALL_ENGINE,
    STOCK_ENV,
    mixed_prompts,
    token_prompts,
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
DTYPES = ["float32", "bfloat16"]
# The device backends: executions inside enqueue, on a device thread that
# holds each one 2 ms longer without a core (an accelerator's asynchrony), or
# on a device thread whose programs are compiled per declared shape.
DEVICES: dict[str, dict[str, str]] = {
    "inline": {"VLLM_NEURON_SCHED_DEVICE": "inline"},
    "thread": {
        "VLLM_NEURON_SCHED_DEVICE": "thread",
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS": "2",
    },
    "compiled": {"VLLM_NEURON_SCHED_DEVICE": "compiled"},
}
# The compiled device's engines: stock's compile mode (our runner compiles
# per shape), on dynamo's eager backend (seconds to compile on 2 cores).
COMPILE = {
    "enforce_eager": False,
    "compilation_config": {"mode": 1, "backend": "eager"},
}
# The user's logits processors (``--logits-processors``), or none.
PROCESSORS: dict[str, list[str]] = {
    "no_procs": [],
    "procs": [lp.NEXT_TOKEN, lp.COUNTING_STOP],
}


def _runnable(row: list[str]) -> bool:
    """vLLM refuses custom logits processors with speculation (and so do we,
    at start-up: tests/v1/test_unsupported.py)."""
    return not (len(row) > 5 and row[1] == "async_ngram" and PROCESSORS[row[5]])


ENGINES = [
    tuple(row)
    for row in covering_rows(
        [
            list(MODELS),
            list(MODES),
            LOGPROBS_MODES,
            DTYPES,
            list(DEVICES),
            list(PROCESSORS),
        ],
        _runnable,
    )
]
ROUNDS = 2
TOLERANCE = 1e-4
# Stop tokens a request reaches at once: most of the vocabulary.
STOPS = list(range(100, 700))


def _requests(processors: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The mixed prompts greedy, logprobs everywhere, prompt logprobs on two,
    penalties and bad words on one, allowed tokens on another; ``min_tokens``
    with stops it reaches
    (and penalties), alone and under a choice grammar; with processors,
    first (their prompts fit the first step: the counting processor counts
    the steps that hold a request, and stock samples a prompt's every chunk,
    we its last), one request for each."""
    greedy = {"temperature": 0.0, "max_tokens": 10, "logprobs": 3}
    prompts = mixed_prompts() + token_prompts([9, 6], stride=3, salt=7)
    params: list[dict[str, Any]] = [
        {**greedy, "ignore_eos": True} for _ in mixed_prompts()
    ]
    params[1]["prompt_logprobs"] = params[4]["prompt_logprobs"] = 2
    params[2].update(presence_penalty=0.5, repetition_penalty=1.1, bad_words=["qu"])
    params[3]["allowed_token_ids"] = list(range(10, 700))
    params += [
        {
            **greedy,
            "max_tokens": 12,
            "min_tokens": 5,
            "stop_token_ids": STOPS,
            "repetition_penalty": 1.2,
            "frequency_penalty": 0.3,
        },
        {**greedy, "min_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}},
    ]
    if PROCESSORS[processors]:
        prompts = token_prompts([5, 7], stride=3, salt=7) + prompts
        params = [
            {**greedy, "max_tokens": 8, "extra_args": {lp.NEXT_TOKEN_ARG: True}},
            {**greedy, "max_tokens": 12, "extra_args": {lp.COUNT_STOP_ARG: 4}},
            *params,
        ]
    return prompts, params


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
    """Stock (sync; no speculation; its own device) per model, logprobs
    mode, dtype and processors the engines pair."""
    keys = sorted({(e[0], e[2], e[3], e[5]) for e in ENGINES})
    runs = []
    for model, logprobs_mode, dtype, processors in keys:
        prompts, params = _requests(processors)
        runs.append(
            {
                "model": models[model],
                "prompts": prompts,
                "sampling": params,
                "engine_kwargs": {
                    **SMALL_ENGINE,
                    "logprobs_mode": logprobs_mode,
                    "dtype": dtype,
                    "logits_processors": PROCESSORS[processors],
                },
                "rounds": ROUNDS,
                "key": [model, logprobs_mode, dtype, processors],
            }
        )
    return runs


@pytest.fixture(scope="module")
def stock(models: dict[str, str]) -> Any:
    """Starts with the module and runs while our engines do."""
    runs = _stock_runs(models)
    child = start_each_in_subprocess(runs, env=STOCK_ENV)

    def of(*key: str) -> list[dict[str, Any]]:
        keys = [run["key"] for run in runs]
        return child.result()[keys.index(list(key))]

    return of


@pytest.mark.parametrize(
    ("model", "mode", "logprobs_mode", "dtype", "device", "processors"),
    ENGINES,
    ids=["-".join(e) for e in ENGINES],
)
def test_engine_settings_in_pairs_equal_stock(
    models: dict[str, str],
    stock: Any,
    model: str,
    mode: str,
    logprobs_mode: str,
    dtype: str,
    device: str,
    processors: str,
) -> None:
    engine = {
        **SMALL_ENGINE,
        **MODES[mode],
        "logprobs_mode": logprobs_mode,
        "dtype": dtype,
        "logits_processors": PROCESSORS[processors],
        **(COMPILE if device == "compiled" else {}),
    }
    prompts, params = _requests(processors)
    with (
        mock.patch.dict(os.environ, DEVICES[device]),
        in_process_llm(models[model], **engine) as llm,
    ):
        (graphs,) = llm.collective_rpc("get_compiled_shapes")
        ours = [r for _ in range(ROUNDS) for r in generate(llm, prompts, params)]
        # Compiled: nothing compiled while serving (the stance would have
        # failed the step, and the graphs would have grown).
        (after,) = llm.collective_rpc("get_compiled_shapes")
        calls = after.pop("program_calls", {})
        graphs.pop("program_calls", None)
        assert after == graphs
    if device == "compiled":
        assert graphs["declared"] and graphs["forward_graphs"] >= len(
            graphs["declared"]
        )
        verify = {"accept_drafts", "propose_ngram_drafts"}
        assert (verify <= set(graphs["program_graphs"])) == (mode == "async_ngram")
        # Steps sample in the programs, the rules included, except where the
        # user's processors are (vLLM's sampler runs them).
        in_programs = not PROCESSORS[processors]
        for program in (
            "sample_rows",
            "mask_tokens",
            "mask_bad_words",
            "mask_min_tokens",
            "penalize_queries",
        ):
            assert (calls[program] > 0) == in_programs, calls
    theirs = stock(model, logprobs_mode, dtype, processors)
    for i, (record, expected) in enumerate(zip(ours, theirs, strict=True)):
        if dtype == "bfloat16":
            assert_within_bf16_floor(record, expected, BF16_LOGPROB_FLOOR)
            continue
        assert record["token_ids"] == expected["token_ids"], i
        assert record["finish_reason"] == expected["finish_reason"], i
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


# vLLM's worker RPCs (docs/vllm-options.md lists each): those that change
# the weights run in the device's order; those ours does not run are refused
# by name.
REFUSED_RPCS = [
    ("execute_dummy_batch", ()),
    ("init_weight_transfer_engine", ({},)),
    ("start_weight_update", ()),
    ("update_weights", ({},)),
    ("finish_weight_update", ()),
    ("handle_ft_command", (None,)),
    ("checkpoint_prepare", ()),
]


def test_worker_rpcs_run_in_the_devices_order_or_are_refused_by_name(
    checkpoint_dir: str, tmp_path: Path
) -> None:
    prompts = token_prompts([9, 6], stride=3, salt=7)
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    engine = {**SMALL_ENGINE, **MODES["async"]}
    with (
        mock.patch.dict(os.environ, DEVICES["thread"]),
        in_process_llm(checkpoint_dir, **engine) as llm,
    ):

        def tokens() -> list[list[int]]:
            return [r["token_ids"] for r in generate(llm, prompts, params)]

        before = tokens()
        llm.collective_rpc("reset_weights")  # every weight zero: token 0
        assert tokens() == [[0] * 6] * 2
        llm.collective_rpc("reload_weights")
        assert tokens() == before
        llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
        assert tokens() == before
        assert llm.collective_rpc("get_draft_model") == [None]
        assert llm.collective_rpc("get_encoder_timing_stats") == [{}]
        assert llm.collective_rpc("compute_weight_checksums")[0]
        assert "LlamaForCausalLM" in llm.collective_rpc("get_model_inspection")[0]
        llm.collective_rpc("save_sharded_state", args=(str(tmp_path),))
        assert any(tmp_path.iterdir())
        for name in ("list_loras", "add_lora"):
            args = () if name == "list_loras" else (None,)
            with pytest.raises(Exception, match="LoRA is not enabled"):
                llm.collective_rpc(name, args=args)
        for name, args in REFUSED_RPCS:
            with pytest.raises(
                Exception, match=f"does not run the worker RPC '{name}'"
            ):
                llm.collective_rpc(name, args=args)
        with pytest.raises(Exception, match="Profiling is not enabled"):
            llm.collective_rpc("profile", args=(True,))
        assert tokens() == before  # and it serves on
