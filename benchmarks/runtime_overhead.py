"""What the device runtime itself costs per execution, on each backend.

``python -m benchmarks.runtime_overhead [--executions N] [--repeats R]``

A chain of trivial executions, each taking the previous one's future as its
argument (as sampling takes the forward's logits), then one host read: the
cost of enqueue, future resolution and completion, with no device work. A
step enqueues two or three executions.
"""

import argparse
import statistics
import time

from vllm_neuron_sched.runtime import make_device
from vllm_neuron_sched.runtime.backends import DEVICE_BACKENDS


def microseconds_per_execution(kind: str, executions: int, repeats: int) -> float:
    device = make_device(kind, 0.0, "overhead")
    try:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            future = device.enqueue(int, 1)
            for _ in range(executions - 1):
                future = device.enqueue(int, future)
            future.result()
            runs.append((time.perf_counter() - start) / executions * 1e6)
        return statistics.median(runs)
    finally:
        device.shutdown(timeout_s=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executions", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for kind in DEVICE_BACKENDS:
        cost = microseconds_per_execution(kind, args.executions, args.repeats)
        print(f"{kind:8s} {cost:6.1f} us per execution (median of {args.repeats})")


if __name__ == "__main__":
    main()
