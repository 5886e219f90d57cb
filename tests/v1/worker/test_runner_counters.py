"""The async counters count structure, not timing, on every backend.

A step is async when its decode rows took their input ids from the device
token table and its host needed no device result the engine had not read; a
fallback when it needed one. On the default (inline) device every result is
there by the time ``enqueue`` returns, so a counter defined by whether the
device was done could never show a fallback there: each test runs on the
default device and on a device thread and expects the same counts.
"""

from vllm_neuron_sched.testing.toy_runner import (
    EngineLoop,
    ScriptedScheduler,
    expected_output,
    toy_runner,
)
from vllm_neuron_sched.worker.async_flow import StepState


def _counts(loop: EngineLoop) -> dict[str, int]:
    return loop.runner.get_async_scheduling_stats()


def _scheduler(**prompts: list[int]) -> ScriptedScheduler:
    sched = ScriptedScheduler()
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt)
    return sched


def _assert_tokens(loop: EngineLoop, sched_prompts: dict[str, list[int]]) -> None:
    for req_id, prompt in sched_prompts.items():
        got = loop.tokens.get(req_id, [])
        assert got == expected_output(prompt, len(got)), req_id


PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8, 9, 7]}


def test_decode_steps_fed_from_the_table_count_async(backend: str) -> None:
    """Fails if decode rows took their ids from the host instead."""
    sched = _scheduler(**PROMPTS)
    with toy_runner(is_async=True) as runner:
        assert runner.device.kind == ("thread" if backend == "thread" else "inline")
        loop = EngineLoop(runner, depth=2)
        loop.run(sched.prefill("a"), sched.prefill("b"))
        loop.run(*(sched.decode("a", "b") for _ in range(4)))
        loop.flush()
        assert _counts(loop) == {
            "async_steps": 4,
            "sync_fallback_steps": 0,
            "prefill_steps": 2,
            "host_waits": 0,
            "dead_tokens": 0,
        }
        assert loop.states == [StepState.HOST_INPUTS] * 2 + [StepState.ASYNC] * 4
    _assert_tokens(loop, PROMPTS)


def test_a_step_the_engine_has_not_read_is_a_fallback(backend: str) -> None:
    """Three steps in flight where the batch queue allows two: the third
    must read the first before the engine did (a done device changes
    nothing)."""
    sched = _scheduler(a=PROMPTS["a"])
    with toy_runner(is_async=True) as runner:
        loop = EngineLoop(runner, depth=4)
        loop.run(sched.prefill("a"), sched.decode("a"), sched.decode("a"))
        loop.flush()
        loop.depth = 2
        loop.run(sched.decode("a"), sched.decode("a"))
        loop.flush()
        counts = _counts(loop)
    assert loop.states == [
        StepState.HOST_INPUTS,
        StepState.ASYNC,
        StepState.SYNC_FALLBACK,
        StepState.ASYNC,
        StepState.ASYNC,
    ]
    assert counts["sync_fallback_steps"] == 1
    assert counts["host_waits"] == 1
    assert counts["async_steps"] == 3
    _assert_tokens(loop, {"a": PROMPTS["a"]})


def test_an_rpc_that_drains_the_flow_is_a_host_wait(backend: str) -> None:
    sched = _scheduler(a=PROMPTS["a"])
    with toy_runner(is_async=True) as runner:
        loop = EngineLoop(runner, depth=2)
        loop.run(sched.prefill("a"), sched.decode("a"))
        # The engine has read the prefill's output, not the decode's yet.
        assert runner.get_rank_state()["in_flight_steps"] == 2
        loop.run(sched.decode("a"))
        loop.flush()
        counts = _counts(loop)
    assert counts["host_waits"] == 1
    assert counts["sync_fallback_steps"] == 0
    assert counts["async_steps"] == 2
    _assert_tokens(loop, {"a": PROMPTS["a"]})


def test_sync_mode_waits_in_every_step(backend: str) -> None:
    """A prompt chunk that samples nothing included: its host reads the
    forward's result before the engine moves on."""
    long_prompt = [(7 * i + 2) % 97 for i in range(40)]  # chunks of 32 and 8
    sched = _scheduler(a=PROMPTS["a"], d=long_prompt)
    with toy_runner(is_async=False) as runner:
        loop = EngineLoop(runner, depth=1)
        loop.run(sched.prefill("a"), sched.decode("a"), sched.prefill("d", 32))
        loop.run(sched.decode("a"), sched.prefill("d"), sched.decode("a", "d"))
        counts = _counts(loop)
    assert loop.states == [StepState.SYNC_FALLBACK] * 6
    assert counts == {
        "async_steps": 0,
        "sync_fallback_steps": 6,
        "prefill_steps": 3,
        "host_waits": 6,
        "dead_tokens": 0,
    }
    _assert_tokens(loop, {"a": PROMPTS["a"], "d": long_prompt})
