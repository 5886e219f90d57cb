"""Prometheus counters of the async flow, on the API server's ``/metrics``.

The counters live in the worker processes, two spawns away from the API
server. vLLM's own multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) cannot be
switched on from a plugin: ``prometheus_client`` fixes its value class when it
is imported, which the API server does before our platform runs, so setting the
variable then hides every front-end metric of vLLM's from ``/metrics``.
Instead, the front end makes a directory of its own, registers a
``MultiProcessCollector`` for it on the default registry (the one ``/metrics``
serves) and hands the path to its children in
``VLLM_NEURON_SCHED_METRICS_DIR``; the driver worker writes its counters there
in prometheus_client's multiprocess file format (a memory write per step).
"""

import atexit
import os
import shutil
import tempfile
import time

from prometheus_client import REGISTRY
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from vllm.logger import init_logger

from vllm_neuron_sched import envs

logger = init_logger(__name__)

METRICS_DIR_ENV = "VLLM_NEURON_SCHED_METRICS_DIR"

# Stats key (worker.get_async_scheduling_stats) -> (counter name, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "async_steps": (
        "vllm:neuron_sched_async_steps",
        "Steps whose decode rows took their input ids from the device token "
        "table and whose host needed no device result the engine had not read.",
    ),
    "sync_fallback_steps": (
        "vllm:neuron_sched_sync_fallback_steps",
        "Steps whose host needed a device result before the engine had read it "
        "(every step in sync mode; prefill steps included).",
    ),
    "prefill_steps": (
        "vllm:neuron_sched_prefill_steps",
        "Prompt-chunk steps (host inputs by nature).",
    ),
    "host_waits": (
        "vllm:neuron_sched_host_waits",
        "Reads of a device result ahead of the engine, in a step or an RPC that "
        "drains the flow; counted by structure, whether or not the device was done.",
    ),
    "dead_tokens": (
        "vllm:neuron_sched_dead_tokens",
        "Tokens computed for requests that had already finished (EOS, stop "
        "token or string, abort): the run-ahead step, discarded.",
    ),
}


def setup_metrics_export() -> None:
    """In the front-end process, before the engine is spawned: once.

    A child process inherits the variable and does nothing here.
    """
    if envs.VLLM_NEURON_SCHED_METRICS_DIR:
        return
    directory = tempfile.mkdtemp(prefix="vllm_neuron_sched_metrics_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[METRICS_DIR_ENV] = directory
    MultiProcessCollector(REGISTRY, path=directory)
    logger.debug("Async scheduling counters are exported from %s", directory)


class CounterPublisher:
    """Writes one engine's counters where the front end's collector reads
    them. One worker per engine publishes (its TP rank 0: every rank runs the
    same flow), labelled as vLLM labels its own, ``model_name`` and
    ``engine`` (the data-parallel rank), so replicas show side by side."""

    def __init__(self, directory: str, labels: dict[str, str]) -> None:
        self._file = MmapedDict(os.path.join(directory, f"counter_{os.getpid()}.db"))
        self._labels = labels
        self._published: dict[str, int] = {}

    @classmethod
    def from_env(cls, model_name: str, engine: int) -> "CounterPublisher | None":
        directory = envs.VLLM_NEURON_SCHED_METRICS_DIR
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, {"model_name": model_name, "engine": str(engine)})

    def publish(self, stats: dict[str, int]) -> None:
        now = time.time()
        for key, (name, help_text) in COUNTERS.items():
            value = stats.get(key, 0)
            if self._published.get(key) == value:
                continue
            self._published[key] = value
            key = mmap_key(
                name,
                f"{name}_total",
                list(self._labels),
                list(self._labels.values()),
                help_text,
            )
            self._file.write_value(key, float(value), now)
