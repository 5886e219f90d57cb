"""The real runner on the toy model (``testing/toy_runner.py``) and a simulated
engine loop with every thread busy: the main thread builds step N+1 while the
device thread runs step N and the output thread materializes it (as
MultiprocExecutor's async_output_busy_loop does)."""

import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_neuron_sched.testing.toy_runner import (
    CHUNK,
    MAX_NUM_SEQS,
    VOCAB,
    MainThreadOnlyArray,
    expected_output,
    scheduler_output,
    toy_runner,
)
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner


@dataclass
class SimRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    num_placeholders: int = 0  # scheduled tokens whose output is not back yet
    is_finished: bool = False


class SimScheduler:
    """Just enough of vLLM's (Async)Scheduler: chunked prefill, placeholders,
    random stops (EOS-like, so run-ahead yields dead tokens), arrivals."""

    def __init__(
        self, rng: random.Random, num_requests: int, allow_mixed: bool
    ) -> None:
        self.rng = rng
        self.allow_mixed = allow_mixed
        self.arrivals = deque(
            SimRequest(
                f"r{i}",
                [rng.randrange(VOCAB) for _ in range(rng.randint(1, 45))],
                rng.randint(1, 30),
            )
            for i in range(num_requests)
        )
        self.running: list[SimRequest] = []
        self.done: list[SimRequest] = []
        self.finished_ids: set[str] = set()
        self.prev_scheduled: set[str] = set()
        self.num_dead_tokens = 0
        self.num_sampling_steps = 0
        self.was_prefill = False

    def has_work(self) -> bool:
        return bool(self.arrivals or self.running or self.finished_ids)

    def schedule(self) -> SchedulerOutput:
        while (
            self.arrivals
            and len(self.running) < MAX_NUM_SEQS
            and self.rng.random() < 0.4
        ):
            self.running.append(self.arrivals.popleft())
        prefills = [r for r in self.running if r.num_computed < len(r.prompt)]
        decodes = [
            r
            for r in self.running
            if r.num_computed >= len(r.prompt)
            and len(r.output) + r.num_placeholders < r.max_tokens
        ]
        if self.allow_mixed:
            chosen_prefills, chosen_decodes = prefills[:1], decodes
        elif prefills and (not decodes or not self.was_prefill):
            chosen_prefills, chosen_decodes = prefills[:1], []
        else:
            chosen_prefills, chosen_decodes = [], decodes
        self.was_prefill = bool(chosen_prefills)

        num_scheduled: dict[str, int] = {}
        new_reqs, cached = [], CachedRequestData([], set(), [], {}, [], [], [])
        budget = CHUNK - len(chosen_decodes)
        for r in chosen_decodes + chosen_prefills:
            is_prefill = r.num_computed < len(r.prompt)
            n = min(budget, len(r.prompt) - r.num_computed) if is_prefill else 1
            if n <= 0:
                continue
            num_scheduled[r.req_id] = n
            if r.num_computed == 0:
                new_reqs.append(
                    NewRequestData(
                        r.req_id,
                        list(r.prompt),
                        [],
                        SamplingParams(temperature=0.0, max_tokens=r.max_tokens),
                        None,
                        ([],),
                        0,
                        None,
                    )
                )
            else:
                cached.req_ids.append(r.req_id)
                if r.req_id not in self.prev_scheduled:
                    cached.all_token_ids[r.req_id] = r.prompt + r.output
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r.num_computed)
                cached.num_output_tokens.append(len(r.output) + r.num_placeholders)
            r.num_computed += n
            if r.num_computed >= len(r.prompt):
                r.num_placeholders += 1
            if is_prefill:
                budget -= n
        finished, self.finished_ids = self.finished_ids, set()
        self.prev_scheduled = set(num_scheduled)
        scheduled = [
            r for r in chosen_decodes + chosen_prefills if r.req_id in num_scheduled
        ]
        if any(r.num_computed >= len(r.prompt) for r in scheduled):
            self.num_sampling_steps += 1
        return scheduler_output(new_reqs, cached, num_scheduled, finished)

    def update(self, output: ModelRunnerOutput) -> None:
        by_id = {r.req_id: r for r in self.running + self.done}
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            if not tokens:
                continue
            r = by_id[req_id]
            r.num_placeholders -= 1
            if r.is_finished:
                self.num_dead_tokens += 1
                continue
            r.output.extend(tokens)
            if len(r.output) >= r.max_tokens or self.rng.random() < 0.08:
                r.is_finished = True
                self.running.remove(r)
                self.done.append(r)
                self.finished_ids.add(r.req_id)


def run_engine_loop(
    runner: NeuronSchedModelRunner, sched: SimScheduler, depth: int
) -> None:
    """step_with_batch_queue (depth 2) or step (depth 1), with an output
    thread that materializes every output, as the multiproc executor does."""
    outputs: queue.Queue = queue.Queue()

    def output_loop() -> None:
        while (item := outputs.get()) is not None:
            result, future = item
            time.sleep(random.random() * 0.002)  # keep the output thread busy
            try:
                if isinstance(result, AsyncModelRunnerOutput):
                    result = result.get_output()
                future.set_result(result)
            except Exception as exc:  # surfaces in the main loop
                future.set_exception(exc)

    thread = threading.Thread(target=output_loop, daemon=True)
    thread.start()
    batch_queue: deque = deque()
    try:
        while sched.has_work() or batch_queue:
            if sched.has_work() and len(batch_queue) < depth:
                scheduler_output = sched.schedule()
                result = runner.execute_model(scheduler_output)
                executed = scheduler_output.total_num_scheduled_tokens > 0
                if executed:
                    result = runner.sample_tokens(None)
                assert len(runner.flow.in_flight) <= 2
                future: Future = Future()
                outputs.put((result, future))
                batch_queue.appendleft(future)
                if len(batch_queue) < depth and executed:
                    continue
            if batch_queue:
                sched.update(batch_queue.pop().result(timeout=30))
    finally:
        outputs.put(None)
        thread.join(timeout=10)


@pytest.mark.parametrize("allow_mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_runner_tokens_survive_races(
    monkeypatch: pytest.MonkeyPatch, seed: int, allow_mixed: bool
) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    sched = SimScheduler(random.Random(seed), num_requests=24, allow_mixed=allow_mixed)
    with toy_runner(is_async=True, max_delay_s=0.002) as runner:
        run_engine_loop(runner, sched, depth=2)

    assert len(sched.done) == 24
    assert MainThreadOnlyArray.foreign_writers == []
    for r in sched.done:
        assert r.output == expected_output(r.prompt, len(r.output)), r.req_id
    stats = runner.get_async_scheduling_stats()
    assert stats["async_steps"] > 0
    assert stats["dead_tokens"] == sched.num_dead_tokens
    assert sched.num_dead_tokens > 0  # run-ahead past random stops happened


@pytest.mark.parametrize("device", ["thread", "inline"])
def test_async_runner_on_each_device_backend(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", device)
    sched = SimScheduler(random.Random(7), num_requests=10, allow_mixed=False)
    with toy_runner(is_async=True, max_delay_s=0.002) as runner:
        run_engine_loop(runner, sched, depth=2)
    assert runner.device.kind == device
    for r in sched.done:
        assert r.output == expected_output(r.prompt, len(r.output)), r.req_id
    assert MainThreadOnlyArray.foreign_writers == []


@pytest.mark.parametrize("seed", [0, 1])
def test_sync_runner_matches_the_toy_oracle(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    sched = SimScheduler(random.Random(seed), num_requests=12, allow_mixed=True)
    with toy_runner(is_async=False, max_delay_s=0.002) as runner:
        run_engine_loop(runner, sched, depth=1)
    for r in sched.done:
        assert r.output == expected_output(r.prompt, len(r.output)), r.req_id
    assert sched.num_dead_tokens == 0
    stats = runner.get_async_scheduling_stats()
    # Sync mode hands every sampling step's tokens back before the next step.
    assert stats["async_steps"] == 0
    assert stats["sync_fallback_steps"] == sched.num_sampling_steps > 0
