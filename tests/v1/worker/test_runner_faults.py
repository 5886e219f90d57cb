"""No device failure goes unread: the real runner on the toy model, with one
device execution made to fail (``Device.fail_execution_after``).

A failed forward or sampling fails the requests of its step (the engine
finishes them with an error and serves the others); a failed state update
(KV zeroing) leaves the device state unknown, so
the engine stops with the cause. A prompt chunk that samples nothing is a
step like any other here: its forward's failure reaches its request too.
"""

import pytest

from vllm_neuron_sched.runtime import DeviceExecutionError, DeviceStateError
from vllm_neuron_sched.testing.toy_runner import (
    EngineLoop,
    ScriptedScheduler,
    expected_output,
    toy_runner,
)

A = [3, 1, 4, 1, 5]
LONG = [(7 * i + 2) % 97 for i in range(70)]  # chunks of 32, 32 and 6


MODES = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


@MODES
def test_a_failed_chunk_that_samples_nothing_fails_its_request(
    backend: str, is_async: bool
) -> None:
    sched = ScriptedScheduler()
    sched.add("a", A)
    sched.add("d", LONG)
    with toy_runner(is_async=is_async) as runner:
        loop = EngineLoop(runner, depth=2 if is_async else 1)
        loop.run(sched.prefill("a"), sched.decode("a"))
        # The batch change (a leaves, d joins), then d's first chunk's forward.
        runner.device.fail_execution_after(2)
        loop.run(sched.prefill("d", 32), sched.decode("a"))
        loop.flush()
        assert set(loop.failed) == {"d"}
        assert "injected device fault" in loop.failed["d"]
        sched.finish("d")  # what our scheduler does with a failed request
        loop.run(sched.decode("a"), sched.decode("a"))
        loop.flush()
        assert runner.get_rank_state()["num_requests"] == 1
    assert loop.tokens["d"] == []
    assert loop.tokens["a"] == expected_output(A, 5)


@MODES
def test_a_failed_sampling_fails_the_steps_requests(
    backend: str, is_async: bool
) -> None:
    sched = ScriptedScheduler()
    for req_id in ("a", "b", "c"):
        sched.add(req_id, [*A, ord(req_id) % 97])
    with toy_runner(is_async=is_async) as runner:
        loop = EngineLoop(runner, depth=2 if is_async else 1)
        loop.run(sched.prefill("a"), sched.prefill("b"), sched.decode("a", "b"))
        runner.device.fail_execution_after(2)  # the decode step's sampling
        loop.run(sched.decode("a", "b"), sched.prefill("c"))
        loop.flush()
        assert set(loop.failed) == {"a", "b"}
        sched.finish("a")
        sched.finish("b")
        loop.run(sched.decode("c"), sched.decode("c"))
        loop.flush()
    for req_id in ("a", "b"):
        assert loop.tokens[req_id] == expected_output([*A, ord(req_id) % 97], 2)
    assert loop.tokens["c"] == expected_output([*A, ord("c") % 97], 3)


@MODES
def test_a_failed_state_update_stops_the_engine(backend: str, is_async: bool) -> None:
    """KV zeroing fails: no later output can be trusted, so reading one
    raises, with the zeroing's failure as the cause."""
    sched = ScriptedScheduler()
    sched.add("a", A)
    with toy_runner(is_async=is_async) as runner:
        loop = EngineLoop(runner, depth=2 if is_async else 1)
        loop.run(sched.prefill("a"))
        loop.flush()
        step = sched.decode("a")
        step.new_block_ids_to_zero = [3]
        runner.device.fail_execution_after(1)  # the zeroing
        with pytest.raises(DeviceStateError) as error:
            loop.run(step)
            loop.flush()
    assert "injected device fault" in repr(error.value.__cause__)


def test_under_a_scheduler_that_cannot_fail_one_request_a_fault_stops_the_engine(
    backend: str,
) -> None:
    """vLLM's own scheduler would wait forever for the failed request's
    tokens (and decode it from a stale table): the error goes up instead."""
    sched = ScriptedScheduler()
    sched.add("a", A)
    vllm_scheduler = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    with toy_runner(is_async=True, scheduler_cls=vllm_scheduler) as runner:
        loop = EngineLoop(runner, depth=2)
        runner.device.fail_execution_after(2)  # after the batch change: a joins
        with pytest.raises(DeviceExecutionError, match="injected device fault"):
            loop.run(sched.prefill("a"), sched.decode("a"))
            loop.flush()
