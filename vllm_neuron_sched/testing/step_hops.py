"""How many times one decode step enters each module of this package: the
hops a reader follows from ``execute_model`` to the end of ``sample_tokens``.

    python -m vllm_neuron_sched.testing.step_hops

Runs our runner on the toy model (``toy_runner``: async, two requests
decoding), the engine's way: the output of the step before the newest is
read before the next step starts (vLLM's batch queue at depth 2). The device
is the threaded one unless ``VLLM_NEURON_SCHED_DEVICE`` says otherwise: the
executions run on their own thread, as on hardware, so what is counted is the
host's path. A *visit* is a call into a module from outside it (another
module, vLLM, the standard library); returns and calls within a module are
not visits. vLLM splits a step into two calls, so each is counted on its own:
the step's state crosses both (its host update in one, its placeholders in
the other).
"""

import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

_PACKAGE = "vllm_neuron_sched/"


@dataclass(frozen=True)
class Visit:
    caller: str  # a module of the package, or "-" (outside it)
    module: str
    function: str


def _module(path: str) -> str | None:
    if _PACKAGE not in path or "/testing/" in path:
        return None
    return path.split(_PACKAGE, 1)[1]


def module_visits(call: Callable[[], object]) -> list[Visit]:
    """The visits ``call`` makes to the package's modules (harnesses
    excluded), in order, on this thread."""
    visits: list[Visit] = []

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event != "call":
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        caller = frame.f_back
        caller_module = _module(caller.f_code.co_filename) if caller else None
        if caller_module != module:
            visits.append(Visit(caller_module or "-", module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return visits


def decode_step_visits() -> dict[str, list[Visit]]:
    """One async decode step of two requests, after a few warm ones: the
    visits of ``execute_model`` and of ``sample_tokens``."""
    os.environ.setdefault("VLLM_NEURON_SCHED_DEVICE", "thread")
    from vllm_neuron_sched.testing.toy_runner import (
        ScriptedScheduler,
        read_output,
        run_step,
        toy_runner,
    )

    with toy_runner(is_async=True) as runner:
        scheduler = ScriptedScheduler.of({"a": [1, 2, 3, 4], "b": [5, 6, 7]})
        unread = [run_step(runner, scheduler.prefill("a"))]
        for k in range(4):
            step = scheduler.prefill("b") if k == 0 else scheduler.decode("a", "b")
            unread.append(run_step(runner, step))
            read_output(unread.pop(0))  # the engine reads all but the newest
        step = scheduler.decode("a", "b")
        return {
            "execute_model": module_visits(lambda: runner.execute_model(step)),
            "sample_tokens": module_visits(lambda: runner.sample_tokens(None)),
        }


def main() -> None:
    for call, visits in decode_step_visits().items():
        print(f"{call}: {len(visits)} visits")
        for visit in visits:
            print(f"  {visit.caller} -> {visit.module}: {visit.function}")
        repeated = {m: n for m, n in Counter(v.module for v in visits).items() if n > 1}
        print("  visited more than once:", repeated or "none")


if __name__ == "__main__":
    main()
