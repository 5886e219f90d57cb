"""Every ``VLLM_NEURON_SCHED_*`` environment variable, typed, in one place.

Read lazily (``envs.VLLM_NEURON_SCHED_DEVICE``) so tests can set them with
``monkeypatch.setenv`` and worker processes see the values they inherited.
"""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_NEURON_SCHED_DISABLE: bool = False
    VLLM_NEURON_SCHED_DEVICE: str = "auto"
    VLLM_NEURON_SCHED_SIM_DEVICE_MS: float = 0.0
    VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT: int = 0
    VLLM_NEURON_SCHED_PREFILL_INTERLEAVING: bool = True
    VLLM_NEURON_SCHED_POOLING_SHAPES: str = ""
    VLLM_NEURON_SCHED_DECODE_BUCKETS: str = ""
    VLLM_NEURON_SCHED_STATS_INTERVAL_S: float = 10.0
    VLLM_NEURON_SCHED_TIMELINE: bool = False
    VLLM_NEURON_SCHED_METRICS_DIR: str = ""
    VLLM_NEURON_SCHED_FAULT_AT_EXECUTION: int = 0


def _bool(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.getenv(name, default).strip().lower() in ("1", "true", "yes")


environment_variables: dict[str, Callable[[], Any]] = {
    # "1": do not activate the platform; stock vLLM CPU runs (the tests' oracle).
    "VLLM_NEURON_SCHED_DISABLE": _bool("VLLM_NEURON_SCHED_DISABLE", "0"),
    # Device runtime backend: "thread" (a device thread per worker), "inline"
    # (runs at enqueue on the worker's thread), "neuron" (torch-neuronx), or
    # "auto": inline when the device is the worker's own cores, thread when a
    # simulated device latency is set (runtime/backends.py says why).
    "VLLM_NEURON_SCHED_DEVICE": lambda: os.getenv(
        "VLLM_NEURON_SCHED_DEVICE", "auto"
    ).lower(),
    # Each device execution also holds the device this many milliseconds
    # without using a core, to measure overlap on its own. 0 = off.
    "VLLM_NEURON_SCHED_SIM_DEVICE_MS": lambda: float(
        os.getenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", "0")
    ),
    # Volumetric limit: decode batch size * worst-case tkv. 0 = no limit
    # beyond max_num_seqs * max_model_len.
    "VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT": lambda: int(
        os.getenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "0")
    ),
    # Refuse a prefill step right after a prefill step while decodes wait.
    "VLLM_NEURON_SCHED_PREFILL_INTERLEAVING": _bool(
        "VLLM_NEURON_SCHED_PREFILL_INTERLEAVING", "1"
    ),
    # Static pooling shapes, "PROMPT_LENxBATCH,..." e.g. "64x8,256x2".
    # Empty: one shape, max_model_len x max_num_seqs.
    "VLLM_NEURON_SCHED_POOLING_SHAPES": lambda: os.getenv(
        "VLLM_NEURON_SCHED_POOLING_SHAPES", ""
    ),
    # Decode batch buckets, "1,2,4,8". Empty: powers of two up to max_num_seqs.
    "VLLM_NEURON_SCHED_DECODE_BUCKETS": lambda: os.getenv(
        "VLLM_NEURON_SCHED_DECODE_BUCKETS", ""
    ),
    # Seconds between the worker's async/fallback counter log lines; 0 = off.
    "VLLM_NEURON_SCHED_STATS_INTERVAL_S": lambda: float(
        os.getenv("VLLM_NEURON_SCHED_STATS_INTERVAL_S", "10")
    ),
    # "1": the worker records per-step host/device busy intervals for the
    # benchmarks (worker/timeline.py); read with collective_rpc("get_step_timeline").
    "VLLM_NEURON_SCHED_TIMELINE": _bool("VLLM_NEURON_SCHED_TIMELINE", "0"),
    # Directory where workers publish the Prometheus counters (metrics.py).
    # Set by the platform in the front-end process before it spawns the
    # engine; empty in a process that exports nothing.
    "VLLM_NEURON_SCHED_METRICS_DIR": lambda: os.getenv(
        "VLLM_NEURON_SCHED_METRICS_DIR", ""
    ),
    # Fault injection for reliability tests: the device's Nth execution raises
    # instead of running. 0 = off.
    "VLLM_NEURON_SCHED_FAULT_AT_EXECUTION": lambda: int(
        os.getenv("VLLM_NEURON_SCHED_FAULT_AT_EXECUTION", "0")
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables.keys())
