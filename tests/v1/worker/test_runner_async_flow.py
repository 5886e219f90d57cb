"""The async flow keeps going when the batch changes: decode rows take their
newest token on the device, and the host never waits for one.

Each test drives the real runner on the toy model (``testing/toy_runner.py``)
with hand-written scheduler outputs, the way the engine's depth-2 batch queue
does: a step's output is read before the step two later is scheduled. The
two steps around a batch change run while the device is held by a gate, so
they can only return if the host never waits for a device result; then the
gate opens and every token must be the toy model's.
"""

import threading
from collections import defaultdict
from typing import Any

import pytest
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_neuron_sched.testing.toy_runner import (
    ScriptedScheduler,
    expected_output,
    read_output,
    record_step_states,
    run_step,
    toy_runner,
)
from vllm_neuron_sched.worker.async_flow import StepState
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

# A deadlock detector, not a timing: a runner that waits for the gated device
# never returns until the gate opens.
GATE_TIMEOUT_S = 30.0
PENALTY = 2.0


class Engine:
    """Runs scripted steps through the runner and reads their outputs."""

    def __init__(self, runner: NeuronSchedModelRunner) -> None:
        self.runner = runner
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.states = record_step_states(runner)

    def run(self, *steps: SchedulerOutput) -> None:
        """Steps whose outputs are read at once (the past of the batch queue)."""
        for scheduler_output in steps:
            self._collect(self._run_one(scheduler_output))

    def run_held(self, *steps: SchedulerOutput) -> None:
        """Up to two steps (the batch queue's depth) while the device is held:
        fails if the host waits for the device in any of them."""
        assert len(steps) <= 2
        opened, started = threading.Event(), threading.Event()

        def hold() -> None:
            started.set()
            assert opened.wait(GATE_TIMEOUT_S)

        self.runner.device.enqueue(hold)
        assert started.wait(GATE_TIMEOUT_S)
        outputs: list[Any] = []
        host = threading.Thread(
            target=lambda: outputs.extend(self._run_one(s) for s in steps)
        )
        host.start()
        host.join(GATE_TIMEOUT_S)
        waited = host.is_alive()
        opened.set()
        host.join()
        assert not waited, "the host waited for the held device"
        for output in outputs:
            self._collect(output)

    def _run_one(self, scheduler_output: SchedulerOutput) -> Any:
        return run_step(self.runner, scheduler_output)

    def _collect(self, output: Any) -> None:
        output = read_output(output)
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            self.tokens[req_id].extend(tokens)


@pytest.fixture
def thread_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")


def _prompt(seed: int, length: int) -> list[int]:
    return [(13 * seed + 5 * i + 1) % 97 for i in range(length)]


def _assert_tokens(
    engine: Engine, sched_prompts: dict[str, list[int]], penalty: float | None = None
) -> None:
    for req_id, prompt in sched_prompts.items():
        got = engine.tokens[req_id]
        assert got == expected_output(prompt, len(got), penalty), req_id


def _assert_no_fallback(runner: NeuronSchedModelRunner, num_async: int) -> None:
    stats = runner.get_async_scheduling_stats()
    assert stats["sync_fallback_steps"] == 0
    assert stats["async_steps"] == num_async


@pytest.mark.usefixtures("thread_device")
def test_join_right_after_a_prefill() -> None:
    prompts = {"a": _prompt(1, 5), "b": _prompt(2, 9)}
    sched = ScriptedScheduler.of(prompts)
    with toy_runner(is_async=True) as runner:
        engine = Engine(runner)
        engine.run(sched.prefill("a"), sched.decode("a"), sched.decode("a"))
        # b's first token comes from the prefill step, a's from the step before.
        engine.run_held(sched.prefill("b"), sched.decode("a", "b"))
        engine.run(sched.decode("a", "b"), sched.decode("b", "a"))
        assert engine.states[-3] is StepState.ASYNC
        _assert_no_fallback(runner, num_async=5)
    _assert_tokens(engine, prompts)
    assert len(engine.tokens["b"]) == 4


@pytest.mark.usefixtures("thread_device")
def test_finish_on_max_tokens() -> None:
    prompts = {"a": _prompt(3, 6), "b": _prompt(4, 11)}
    sched = ScriptedScheduler.of(prompts)
    with toy_runner(is_async=True) as runner:
        engine = Engine(runner)
        engine.run(sched.prefill("a"), sched.prefill("b"), sched.decode("a", "b"))
        # a reached max_tokens: it leaves the batch a step before the
        # scheduler lists it as finished.
        without_a = sched.decode("b")
        sched.finish("a")
        engine.run_held(without_a, sched.decode("b"))
        engine.run(sched.decode("b"))
        _assert_no_fallback(runner, num_async=4)
    _assert_tokens(engine, prompts)
    assert len(engine.tokens["a"]) == 2 and len(engine.tokens["b"]) == 5


@pytest.mark.usefixtures("thread_device")
def test_abort() -> None:
    prompts = {"a": _prompt(5, 4), "b": _prompt(6, 8), "c": _prompt(7, 3)}
    sched = ScriptedScheduler.of(prompts)
    with toy_runner(is_async=True) as runner:
        engine = Engine(runner)
        engine.run(*(sched.prefill(r) for r in prompts), sched.decode("a", "b", "c"))
        held = sched.decode("a", "b", "c")
        sched.finish("b")  # aborted by its client while that step runs
        engine.run_held(held, sched.decode("a", "c"))
        engine.run(sched.decode("a", "c"))
        _assert_no_fallback(runner, num_async=4)
        assert runner.get_async_scheduling_stats()["dead_tokens"] == 1
    _assert_tokens(engine, prompts)


@pytest.mark.usefixtures("thread_device")
def test_reorder() -> None:
    prompts = {"a": _prompt(8, 5), "b": _prompt(9, 7), "c": _prompt(10, 2)}
    long_prompt = _prompt(11, 50)  # two chunks of 32
    sched = ScriptedScheduler.of(prompts)
    sched.add("d", long_prompt)
    with toy_runner(is_async=True) as runner:
        engine = Engine(runner)
        engine.run(*(sched.prefill(r) for r in prompts), sched.decode("a", "b", "c"))
        before = list(runner.host.batch.req_ids)
        # A prompt chunk empties the batch; the decodes rejoin in a new order.
        engine.run_held(sched.prefill("d", 32), sched.decode(*reversed(before)))
        assert list(runner.host.batch.req_ids) == before[::-1]
        engine.run(sched.decode("c", "a", "b"))
        _assert_no_fallback(runner, num_async=3)
    _assert_tokens(engine, prompts)
    assert engine.tokens["d"] == []


@pytest.mark.usefixtures("thread_device")
def test_non_final_prompt_chunk_between_decodes() -> None:
    prompts = {"a": _prompt(12, 6), "d": _prompt(13, 70)}
    sched = ScriptedScheduler.of(prompts)
    with toy_runner(is_async=True) as runner:
        engine = Engine(runner)
        engine.run(sched.prefill("a"), sched.decode("a"))
        engine.run_held(sched.prefill("d", 32), sched.decode("a"))
        engine.run_held(sched.prefill("d", 32), sched.decode("a"))
        engine.run(sched.prefill("d"), sched.decode("a", "d"))
        assert engine.states.count(StepState.HOST_INPUTS) == 4
        _assert_no_fallback(runner, num_async=4)
    _assert_tokens(engine, prompts)
    assert len(engine.tokens["d"]) == 2


@pytest.mark.usefixtures("thread_device")
def test_repetition_penalty_across_a_join() -> None:
    """The model prefers repeating its input token; only a penalty that sees
    that token (still on the device) in the history stops it."""
    sched = ScriptedScheduler()
    prompts = {"a": _prompt(14, 5), "b": _prompt(15, 8)}
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, repetition_penalty=PENALTY)
    with toy_runner(is_async=True, repeat_bias=True) as runner:
        engine = Engine(runner)
        engine.run(sched.prefill("a"), sched.decode("a"))
        engine.run_held(sched.prefill("b"), sched.decode("a", "b"))
        engine.run_held(sched.decode("b", "a"), sched.decode("a", "b"))
        engine.run(sched.decode("a", "b"))
        _assert_no_fallback(runner, num_async=5)
    _assert_tokens(engine, prompts, penalty=PENALTY)
    # Without the penalty (or with a history missing the newest token) the
    # model would repeat its input token.
    assert engine.tokens["b"] != expected_output(prompts["b"], 5, 1.0)


@pytest.mark.usefixtures("thread_device")
def test_preempted_requests_give_their_token_slots_back() -> None:
    """The table holds ``max_num_seqs`` slots: a preempted request gives its
    slot back, a new one takes it while the step before still writes it
    (the device is held), and the preempted ones resume in slots others
    used, one past a prefix-cache hit, whose history the penalty reads."""
    prompts = {f"r{i}": _prompt(20 + i, 3 + i) for i in range(6)}
    prompts["n"] = _prompt(40, 7)
    sched = ScriptedScheduler()
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, repetition_penalty=PENALTY)
    first = [f"r{i}" for i in range(6)]
    with toy_runner(is_async=True, repeat_bias=True) as runner:
        engine = Engine(runner)
        engine.run(*(sched.prefill(r) for r in first), sched.decode(*first))
        preempted, in_flight = first[:3], sched.decode(*first)
        sched.preempt(*preempted)
        engine.run_held(in_flight, sched.prefill("n"))
        engine.run(sched.decode("n", *first[3:]), sched.decode("n", *first[3:]))
        sched.finish("n")
        engine.run(sched.resume("r0", engine.tokens["r0"], num_cached=4))
        for req_id in preempted[1:]:
            engine.run(sched.resume(req_id, engine.tokens[req_id]))
        engine.run(sched.decode(*first), sched.decode(*first))
    _assert_tokens(engine, prompts, penalty=PENALTY)
    assert [len(engine.tokens[r]) for r in (*first, "n")] == [6] * 3 + [7] * 3 + [3]
