"""Every ``VLLM_NEURON_SCHED_*`` environment variable, typed, in one place.

Read lazily (``envs.VLLM_NEURON_SCHED_DEVICE``) so tests can set them with
``monkeypatch.setenv`` and worker processes see the values they inherited. A
malformed value raises ``ValueError`` naming the variable and the accepted
form; ``check_values()`` reads them all, so the platform refuses a bad one at
start-up, before any process is spawned.
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
    VLLM_NEURON_SCHED_PREFILL_SHAPES: str = ""
    VLLM_NEURON_SCHED_STATS_INTERVAL_S: float = 10.0
    VLLM_NEURON_SCHED_TIMELINE: bool = False
    VLLM_NEURON_SCHED_METRICS_DIR: str = ""
    VLLM_NEURON_SCHED_FAULT_AT_EXECUTION: int = 0

# The built-in device kinds: "auto", then one per backend class in
# runtime/backends.py (which asserts that at import). An installed package adds
# its own under the entry-point group DEVICE_ENTRY_POINTS. Names only, no
# import, so the variable is checked in processes that load no backend.
BUILTIN_DEVICE_KINDS = ("auto", "thread", "inline", "compiled")
DEVICE_ENTRY_POINTS = "vllm_neuron_sched.devices"


def device_kinds() -> tuple[str, ...]:
    """The built-in kinds, then those installed packages register."""
    from importlib.metadata import entry_points

    plugins = sorted(
        {ep.name.lower() for ep in entry_points(group=DEVICE_ENTRY_POINTS)}
    )
    return BUILTIN_DEVICE_KINDS + tuple(
        k for k in plugins if k not in BUILTIN_DEVICE_KINDS
    )


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _bool(name: str, default: str) -> Callable[[], bool]:
    def read() -> bool:
        value = os.getenv(name, default).strip().lower()
        if value in _TRUE or value in _FALSE:
            return value in _TRUE
        raise ValueError(
            f"{name}={os.environ[name]!r}: expected a boolean, one of "
            f"{', '.join(_TRUE)} or {', '.join(v for v in _FALSE if v)}"
        )

    return read


def _number(
    name: str, default: str, kind: type[int] | type[float], meaning: str
) -> Callable[[], Any]:
    """An int or float >= 0; ``meaning`` completes "expected ..."."""

    def read() -> Any:
        raw = os.getenv(name, default)
        try:
            value = kind(raw.strip())
        except ValueError:
            value = None
        if value is None or value < 0 or value != value:  # NaN
            raise ValueError(f"{name}={raw!r}: expected {meaning}")
        return value

    return read


def _choice(
    name: str, default: str, choices: Callable[[], tuple[str, ...]]
) -> Callable[[], str]:
    def read() -> str:
        value = os.getenv(name, default).strip().lower()
        if value not in (valid := choices()):
            raise ValueError(
                f"{name}={os.environ[name]!r}: expected one of {', '.join(valid)}"
            )
        return value

    return read


def _text(name: str, default: str = "") -> Callable[[], str]:
    return lambda: os.getenv(name, default)


environment_variables: dict[str, Callable[[], Any]] = {
    # "1": do not activate the platform; stock vLLM CPU runs (the tests' oracle).
    "VLLM_NEURON_SCHED_DISABLE": _bool("VLLM_NEURON_SCHED_DISABLE", "0"),
    # Device runtime backend: "thread" (a device thread per worker), "inline"
    # (runs at enqueue on the worker's thread), "compiled" (a device thread
    # running the forward compiled once per declared shape at start-up; a
    # recompile while serving is an error), "auto": inline when the
    # device is the worker's own cores, thread when a simulated device
    # latency is set (runtime/backends.py says why); or a kind an installed
    # package registers (entry-point group vllm_neuron_sched.devices).
    "VLLM_NEURON_SCHED_DEVICE": _choice(
        "VLLM_NEURON_SCHED_DEVICE", "auto", device_kinds
    ),
    # Each device execution also holds the device this many milliseconds
    # without using a core, to measure overlap on its own. 0 = off.
    "VLLM_NEURON_SCHED_SIM_DEVICE_MS": _number(
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS", "0", float, "milliseconds, a number >= 0"
    ),
    # Volumetric limit: decode batch size * worst-case tkv. 0 = no limit
    # beyond max_num_seqs * max_model_len.
    "VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT": _number(
        "VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT",
        "0",
        int,
        "tokens, an integer >= 0 (0: max_num_seqs * max_model_len)",
    ),
    # Refuse a prefill step right after a prefill step while decodes wait.
    "VLLM_NEURON_SCHED_PREFILL_INTERLEAVING": _bool(
        "VLLM_NEURON_SCHED_PREFILL_INTERLEAVING", "1"
    ),
    # Static pooling shapes, "PROMPT_LENxBATCH,..." e.g. "64x8,256x2".
    # Empty: one shape, max_model_len x max_num_seqs. Checked against the
    # configuration at start-up (core/limits.py).
    "VLLM_NEURON_SCHED_POOLING_SHAPES": _text("VLLM_NEURON_SCHED_POOLING_SHAPES"),
    # Decode batch buckets, "1,2,4,8". Empty: 1, 2, 4, then multiples of 8
    # (vLLM's CUDA-graph grid) up to max_num_seqs.
    # Checked against the configuration at start-up (worker/buckets.py).
    "VLLM_NEURON_SCHED_DECODE_BUCKETS": _text("VLLM_NEURON_SCHED_DECODE_BUCKETS"),
    # Static prefill shapes, "ROWSxTOKENS,..." e.g. "1x128,2x64,4x32": a
    # prefill step runs the next chunk of up to ROWS requests, each padded to
    # TOKENS. Empty: powers of two within the step budget. Checked against
    # the configuration at start-up (core/prefill_shapes.py).
    "VLLM_NEURON_SCHED_PREFILL_SHAPES": _text("VLLM_NEURON_SCHED_PREFILL_SHAPES"),
    # Seconds between the worker's async/fallback counter log lines; 0 = off.
    "VLLM_NEURON_SCHED_STATS_INTERVAL_S": _number(
        "VLLM_NEURON_SCHED_STATS_INTERVAL_S",
        "10",
        float,
        "seconds, a number >= 0 (0: no log line)",
    ),
    # "1": the worker records per-step host/device busy intervals for the
    # benchmarks (worker/timeline.py); read with collective_rpc("get_step_timeline").
    "VLLM_NEURON_SCHED_TIMELINE": _bool("VLLM_NEURON_SCHED_TIMELINE", "0"),
    # Directory where workers publish the Prometheus counters (metrics.py).
    # Set by the platform in the front-end process before it spawns the
    # engine; empty in a process that exports nothing.
    "VLLM_NEURON_SCHED_METRICS_DIR": _text("VLLM_NEURON_SCHED_METRICS_DIR"),
    # Fault injection for reliability tests: the device's Nth execution raises
    # instead of running. 0 = off.
    "VLLM_NEURON_SCHED_FAULT_AT_EXECUTION": _number(
        "VLLM_NEURON_SCHED_FAULT_AT_EXECUTION",
        "0",
        int,
        "an execution number, an integer >= 0 (0: no fault)",
    ),
}


def check_values() -> None:
    """Reads every variable; one ``ValueError`` lists every malformed one."""
    errors = []
    for read in environment_variables.values():
        try:
            read()
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ValueError("; ".join(errors))


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables.keys())
