"""The real runner, a toy model, and a simulated engine loop with both threads
busy: the main thread builds step N+1 while the output thread materializes
step N (as MultiprocExecutor's async_output_busy_loop does).

The toy model's next token depends on the previous token and its position, so a
stale or misplaced input id (a host-state race, a wrong remap, a padded row
leaking) changes every later token of that request.
"""

import contextlib
import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_neuron_sched.worker import model_runner as model_runner_module
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

VOCAB = 97
MAX_LEN = 160
CHUNK = 32
MAX_NUM_SEQS = 6


def next_token(token: int, position: int) -> int:
    return (31 * token + 7 * position + 3) % VOCAB


def expected_output(prompt: list[int], num_tokens: int) -> list[int]:
    tokens, last = [], prompt[-1]
    for k in range(num_tokens):
        last = next_token(last, len(prompt) - 1 + k)
        tokens.append(last)
    return tokens


class ToyModel(torch.nn.Module):
    """hidden = (token, position); logits put all mass on next_token()."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time.sleep(random.random() * 0.002)  # keep the device thread busy
        return torch.stack([input_ids.to(torch.float32), positions.float()], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens, positions = hidden[:, 0].long(), hidden[:, 1].long()
        logits = torch.full((hidden.shape[0], VOCAB), -10.0)
        logits[torch.arange(hidden.shape[0]), next_token(tokens, positions)] = 10.0
        return logits


class MainThreadOnlyArray(np.ndarray):
    """Records every write made from a thread other than the main one: the
    async output thread must never write the input batch."""

    foreign_writers: list[str] = []

    def __setitem__(self, key, value) -> None:
        if threading.current_thread() is not threading.main_thread():
            MainThreadOnlyArray.foreign_writers.append(threading.current_thread().name)
        super().__setitem__(key, value)


def make_runner(
    monkeypatch: pytest.MonkeyPatch, is_async: bool
) -> NeuronSchedModelRunner:
    monkeypatch.setattr(
        model_runner_module, "get_tp_group", lambda: SimpleNamespace(rank_in_group=0)
    )
    monkeypatch.setattr(
        model_runner_module,
        "set_forward_context",
        lambda *args, **kwargs: contextlib.nullcontext(),
    )
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        speculative_config=None,
        model_config=SimpleNamespace(
            max_model_len=MAX_LEN,
            get_vocab_size=lambda: VOCAB,
            logprobs_mode="raw_logprobs",
            runner_type="generate",
            logits_processors=None,
        ),
        cache_config=None,
        compilation_config=None,
        scheduler_config=SimpleNamespace(
            async_scheduling=is_async,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=CHUNK,
        ),
    )
    runner = NeuronSchedModelRunner(config, torch.device("cpu"))  # type: ignore[arg-type]
    runner.model = ToyModel()
    runner.input_batch = InputBatch(
        max_num_reqs=MAX_NUM_SEQS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=CHUNK,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
        block_sizes=[16],
        max_num_blocks_per_req=[MAX_LEN // 16],
        logitsprocs=LogitsProcessors(),
    )
    batch = runner.input_batch
    MainThreadOnlyArray.foreign_writers.clear()
    batch.token_ids_cpu = batch.token_ids_cpu.view(MainThreadOnlyArray)
    batch.num_tokens_no_spec = batch.num_tokens_no_spec.view(MainThreadOnlyArray)
    return runner


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
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
        )

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
                assert len(runner._in_flight) <= 2
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
        runner.shutdown()


@pytest.mark.parametrize("allow_mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_runner_tokens_survive_races(
    monkeypatch: pytest.MonkeyPatch, seed: int, allow_mixed: bool
) -> None:
    random.seed(seed)
    runner = make_runner(monkeypatch, is_async=True)
    sched = SimScheduler(random.Random(seed), num_requests=24, allow_mixed=allow_mixed)
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
    runner = make_runner(monkeypatch, is_async=True)
    sched = SimScheduler(random.Random(7), num_requests=10, allow_mixed=False)
    run_engine_loop(runner, sched, depth=2)
    assert runner.accelerator.name == device
    for r in sched.done:
        assert r.output == expected_output(r.prompt, len(r.output)), r.req_id
    assert MainThreadOnlyArray.foreign_writers == []


@pytest.mark.parametrize("seed", [0, 1])
def test_sync_runner_matches_the_toy_oracle(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    runner = make_runner(monkeypatch, is_async=False)
    sched = SimScheduler(random.Random(seed), num_requests=12, allow_mixed=True)
    run_engine_loop(runner, sched, depth=1)
    for r in sched.done:
        assert r.output == expected_output(r.prompt, len(r.output)), r.req_id
    assert sched.num_dead_tokens == 0
    assert runner.get_async_scheduling_stats()["async_steps"] == 0
