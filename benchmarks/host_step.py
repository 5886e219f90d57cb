"""What the runner's host side costs per decode step, with no model to hide it.

``python -m benchmarks.host_step [--steps N] [--repeats R] [--rows B]``

Our runner on the toy model (``testing/toy_runner.py``: a lookup table for a
model, no attention, the inline device), async: ``B`` requests prefilled, then
``N`` decode steps, each read back one step late as the engine does. Per step
the time of ``execute_model`` + ``sample_tokens`` + the read of the step
before: what the host work of the async flow, the step build and the
retirement costs. Compare two checkouts by running it in each, alternating.
"""

import argparse
import statistics
import time

from vllm_neuron_sched.testing.toy_runner import (
    MAX_LEN,
    MAX_NUM_SEQS,
    ScriptedScheduler,
    read_output,
    run_step,
    toy_runner,
)


def microseconds_per_step(steps: int, rows: int) -> float:
    prompts = {f"r{i}": [1 + i, 2, 3, 4] for i in range(rows)}
    with toy_runner(is_async=True) as runner:
        scheduler = ScriptedScheduler.of(prompts)
        for req_id in prompts:
            read_output(run_step(runner, scheduler.prefill(req_id)))
        unread = run_step(runner, scheduler.decode(*prompts))
        start = time.perf_counter()
        for _ in range(steps):
            output = run_step(runner, scheduler.decode(*prompts))
            read_output(unread)
            unread = output
        read_output(unread)
        return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=MAX_LEN - 8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", type=int, default=MAX_NUM_SEQS)
    args = parser.parse_args()
    runs = [microseconds_per_step(args.steps, args.rows) for _ in range(args.repeats)]
    print(
        f"host us per decode step ({args.rows} rows, {args.steps} steps): "
        f"median {statistics.median(runs):.0f} [{min(runs):.0f}, {max(runs):.0f}]"
    )


if __name__ == "__main__":
    main()
