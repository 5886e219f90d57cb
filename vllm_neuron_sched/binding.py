"""A ``VLLM_CPU_OMP_THREADS_BIND`` value for more CPU workers than NUMA
nodes, where vLLM's ``auto`` binding cannot work: the platform suggests it in
its error, the demo, tests and benchmarks set it for TP/DP runs."""

import os
from collections.abc import Iterable


def thread_binding(num_workers: int, cpus: Iterable[int] | None = None) -> str:
    """One ``|``-separated core list per worker: an equal share of ``cpus``
    (default: this process's) each, or the cores round-robin when there are
    fewer than workers (TP=4 on 2 cores: ``0|1|0|1``)."""
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cores) < num_workers:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(num_workers))
    per_worker = len(cores) // num_workers
    groups = [cores[i * per_worker : (i + 1) * per_worker] for i in range(num_workers)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)
