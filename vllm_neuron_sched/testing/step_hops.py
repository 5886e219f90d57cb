"""The modules one decode step passes through, in order: how many hops a
reader follows from ``execute_model`` to the end of ``sample_tokens``.

    python -m vllm_neuron_sched.testing.step_hops

Runs our runner on the toy model (``toy_runner``: async, inline device), two
requests decoding, and records each entry into a module of this package
(harnesses excluded) during one step, with ``sys.setprofile``.
"""

import sys
from collections import Counter
from collections.abc import Callable

from vllm_neuron_sched.testing.toy_runner import (
    ScriptedScheduler,
    read_output,
    run_step,
    toy_runner,
)

_PACKAGE = "vllm_neuron_sched/"


def module_hops(call: Callable[[], object]) -> list[str]:
    """The package's modules ``call`` enters, in order, a run of calls
    within one module counted once."""
    hops: list[str] = []

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event != "call":
            return
        path = frame.f_code.co_filename
        if _PACKAGE in path and "/testing/" not in path:
            module = path.split(_PACKAGE, 1)[1]
            if not hops or hops[-1] != module:
                hops.append(module)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return hops


def decode_step_hops() -> list[str]:
    """One async decode step of two requests, after a few warm ones."""
    with toy_runner(is_async=True) as runner:
        scheduler = ScriptedScheduler.of({"a": [1, 2, 3, 4], "b": [5, 6, 7]})
        unread = [
            run_step(runner, scheduler.prefill("a")),
            run_step(runner, scheduler.prefill("b")),
        ]
        for _ in range(3):
            unread.append(run_step(runner, scheduler.decode("a", "b")))
            read_output(unread.pop(0))
        step = scheduler.decode("a", "b")
        return module_hops(lambda: run_step(runner, step))


def main() -> None:
    hops = decode_step_hops()
    print(f"{len(hops)} hops: " + " -> ".join(hops))
    repeated = {m: n for m, n in Counter(hops).most_common() if n > 1}
    print("entered more than once:", repeated or "none")


if __name__ == "__main__":
    main()
