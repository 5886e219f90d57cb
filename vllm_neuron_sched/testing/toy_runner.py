"""The real model runner around a toy model, without an engine: for tests of
the async flow that must see every token.

The toy model's next token depends on the previous token and its position, so
a stale or misplaced input id (a host-state race, a token taken from the
wrong row or step, a padded row leaking) changes every later token of that
request. ``ScriptedScheduler`` writes the ``SchedulerOutput`` of each step by
hand, the way vLLM's scheduler would, so a test decides exactly which requests
join, finish, get aborted or run a prompt chunk in which step.
"""

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_neuron_sched.platform import (
    ASYNC_CHUNKED_PREFILL_SCHEDULER as ASYNC_SCHEDULER,
)
from vllm_neuron_sched.platform import CHUNKED_PREFILL_SCHEDULER as SYNC_SCHEDULER
from vllm_neuron_sched.runtime import make_device
from vllm_neuron_sched.worker.async_flow import FlowObserver, StepState
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

VOCAB = 97
MAX_LEN = 160
CHUNK = 32
MAX_NUM_SEQS = 6
# The model's logit for its next token, and (with ``repeat_bias``) for
# repeating its input token: higher, so only a repetition penalty that sees
# the input token in the history stops the repeat.
NEXT_LOGIT = 10.0
REPEAT_LOGIT = 10.5


def next_token(token, position):
    """The toy model's greedy next token (ints or tensors)."""
    return (31 * token + 7 * position + 3) % VOCAB


def expected_output(
    prompt: list[int], num_tokens: int, repetition_penalty: float | None = None
) -> list[int]:
    """Greedy tokens of the toy model; with ``repetition_penalty`` those of
    the repeat-biased model under vLLM's repetition penalty (positive logits
    of tokens seen in the prompt or output are divided by it)."""
    tokens: list[int] = []
    last = prompt[-1]
    for k in range(num_tokens):
        following = next_token(last, len(prompt) - 1 + k)
        if repetition_penalty is not None and following != last:
            seen = set(prompt) | set(tokens)
            scores = {following: NEXT_LOGIT, last: REPEAT_LOGIT}
            for token in scores:
                if token in seen:
                    scores[token] /= repetition_penalty
            following = max(scores, key=lambda t: (scores[t], -t))
        last = following
        tokens.append(last)
    return tokens


class ToyModel(torch.nn.Module):
    """hidden = (token, position); logits put the mass on ``next_token``."""

    def __init__(self, repeat_bias: bool = False, max_delay_s: float = 0.0) -> None:
        super().__init__()
        self.repeat_bias = repeat_bias
        self.max_delay_s = max_delay_s
        self._rng = np.random.default_rng(0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.max_delay_s:  # keep the device thread busy for a while
            time.sleep(float(self._rng.random()) * self.max_delay_s)
        return torch.stack([input_ids.to(torch.float32), positions.float()], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens, positions = hidden[:, 0].long(), hidden[:, 1].long()
        rows = torch.arange(hidden.shape[0])
        logits = torch.full((hidden.shape[0], VOCAB), -10.0)
        if self.repeat_bias:
            logits[rows, tokens % VOCAB] = REPEAT_LOGIT
        logits[rows, next_token(tokens, positions)] = NEXT_LOGIT
        return logits


class MainThreadOnlyArray(np.ndarray):
    """Records every write made from a thread other than the main one: the
    async output thread must never write the input batch."""

    foreign_writers: list[str] = []

    def __setitem__(self, key, value) -> None:
        if threading.current_thread() is not threading.main_thread():
            MainThreadOnlyArray.foreign_writers.append(threading.current_thread().name)
        super().__setitem__(key, value)


@contextlib.contextmanager
def toy_runner(
    is_async: bool,
    repeat_bias: bool = False,
    max_delay_s: float = 0.0,
    scheduler_cls: str | None = None,
) -> Iterator[NeuronSchedModelRunner]:
    """Our runner (its device from ``VLLM_NEURON_SCHED_DEVICE``) on the toy
    model, with no distributed group and no attention backend.
    ``scheduler_cls``: the engine's scheduler, ours by default (it finishes a
    failed step's requests alone)."""
    if scheduler_cls is None:
        scheduler_cls = ASYNC_SCHEDULER if is_async else SYNC_SCHEDULER
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            data_parallel_size=1,
            use_sequence_parallel_moe=False,
            is_moe_model=False,
        ),
        speculative_config=None,
        num_speculative_tokens=0,
        # vLLM's batch queue depth (VllmConfig.max_concurrent_batches).
        max_concurrent_batches=2 if is_async else 1,
        model_config=SimpleNamespace(
            max_model_len=MAX_LEN,
            get_vocab_size=lambda: VOCAB,
            logprobs_mode="raw_logprobs",
            use_fp64_gumbel=False,
            runner_type="generate",
            logits_processors=None,
        ),
        compilation_config=SimpleNamespace(
            static_forward_context={},
            fast_moe_cold_start=False,
            static_all_moe_layers=[],
        ),
        scheduler_config=SimpleNamespace(
            scheduler_cls=scheduler_cls,
            async_scheduling=is_async,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=CHUNK,
        ),
    )
    rank_zero = SimpleNamespace(rank_in_group=0, world_size=1)
    runner = NeuronSchedModelRunner(config, rank_zero, make_device(label="tp0"))  # type: ignore[arg-type]
    runner.model = ToyModel(repeat_bias, max_delay_s)
    batch = runner.host.allocate_batch([16], MAX_LEN)
    MainThreadOnlyArray.foreign_writers.clear()
    batch.token_ids_cpu = batch.token_ids_cpu.view(MainThreadOnlyArray)
    batch.num_tokens_no_spec = batch.num_tokens_no_spec.view(MainThreadOnlyArray)
    try:
        yield runner
    finally:
        runner.shutdown()


def run_step(
    runner: NeuronSchedModelRunner, scheduler_output: SchedulerOutput
) -> ModelRunnerOutput | AsyncModelRunnerOutput:
    """One engine step: execute_model, then sample_tokens if it asked for it."""
    output = runner.execute_model(scheduler_output)
    if output is None:
        output = runner.sample_tokens(None)
    return output


def read_output(
    output: ModelRunnerOutput | AsyncModelRunnerOutput,
) -> ModelRunnerOutput:
    """What the engine gets back (the output thread's read, in async mode)."""
    if isinstance(output, AsyncModelRunnerOutput):
        return output.get_output()
    return output


@dataclass
class ScriptedRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    num_computed: int = 0
    num_output: int = 0  # sampled tokens, read back or not
    is_new: bool = True
    # Preempted: its next step runs these again (prompt and outputs).
    resumes_with: list[int] | None = None


@dataclass
class ScriptedScheduler:
    """Writes each step's ``SchedulerOutput`` as vLLM's scheduler would for
    the requests a test names: prompt chunks, decodes, finishes."""

    requests: dict[str, ScriptedRequest] = field(default_factory=dict)
    _finished: set[str] = field(default_factory=set)
    _preempted: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, prompts: dict[str, list[int]]) -> "ScriptedScheduler":
        """A scheduler that knows these requests (none scheduled yet)."""
        sched = cls()
        for req_id, prompt in prompts.items():
            sched.add(req_id, prompt)
        return sched

    def add(
        self, req_id: str, prompt: list[int], repetition_penalty: float = 1.0
    ) -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_LEN, repetition_penalty=repetition_penalty
        )
        self.requests[req_id] = ScriptedRequest(req_id, list(prompt), params)

    def finish(self, req_id: str) -> None:
        """Stopped (EOS, stop string, max_tokens) or aborted: the next step
        lists it as finished."""
        self._finished.add(req_id)
        del self.requests[req_id]

    def preempt(self, *req_ids: str) -> None:
        """Out of the batch, its KV freed: the next step lists it as
        preempted."""
        self._preempted.update(req_ids)

    def resume(
        self, req_id: str, outputs: list[int], num_cached: int = 0
    ) -> SchedulerOutput:
        """A preempted request runs its prompt and ``outputs`` (the tokens
        it sampled) again, past its prefix-cache hit ``num_cached``, in one
        chunk."""
        request = self.requests[req_id]
        request.resumes_with = [*request.prompt, *outputs]
        request.num_computed, request.num_output = num_cached, len(outputs)
        return self._step({req_id: len(request.resumes_with) - num_cached})

    def prefill(self, req_id: str, num_tokens: int | None = None) -> SchedulerOutput:
        """One prompt chunk (the rest of the prompt by default)."""
        request = self.requests[req_id]
        left = len(request.prompt) - request.num_computed
        return self._step({req_id: left if num_tokens is None else num_tokens})

    def decode(self, *req_ids: str) -> SchedulerOutput:
        return self._step(dict.fromkeys(req_ids, 1))

    def _step(self, num_scheduled: dict[str, int]) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData([], set(), [], {}, [], [], [])
        for req_id, num_tokens in num_scheduled.items():
            r = self.requests[req_id]
            if r.is_new:
                new_reqs.append(
                    NewRequestData(
                        req_id, list(r.prompt), [], r.params, None, ([],), 0, None
                    )
                )
                r.is_new = False
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(None if r.resumes_with is None else ([],))
                if r.resumes_with is not None:
                    cached.resumed_req_ids.add(req_id)
                    cached.all_token_ids[req_id] = r.resumes_with
                    r.resumes_with = None
                cached.num_computed_tokens.append(r.num_computed)
                cached.num_output_tokens.append(r.num_output)
            r.num_computed += num_tokens
            if r.num_computed >= len(r.prompt):
                r.num_output += 1
        finished, self._finished = self._finished, set()
        output = scheduler_output(new_reqs, cached, num_scheduled, finished)
        output.preempted_req_ids, self._preempted = self._preempted, set()
        return output


def scheduler_output(
    new_reqs: list[NewRequestData],
    cached: CachedRequestData,
    num_scheduled: dict[str, int],
    finished: set[str],
) -> SchedulerOutput:
    """A text-only step's ``SchedulerOutput`` (no spec decode, no encoder)."""
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


class _StepStates(FlowObserver):
    def __init__(self) -> None:
        self.states: list[StepState] = []

    def step_ended(self, step: int, state: StepState) -> None:
        self.states.append(state)


def record_step_states(runner: NeuronSchedModelRunner) -> list[StepState]:
    """A list that the runner's flow appends each ended step's state to."""
    recorder = _StepStates()
    runner.flow.subscribe(recorder)
    return recorder.states


def record_timeline(
    is_async: bool, num_decodes: int, output_thread: bool = False
) -> dict[str, Any]:
    """The step timeline of a prefill per request then ``num_decodes`` decodes
    of two requests, outputs read one step late (async) or at once (sync),
    on this thread or, with ``output_thread``, on another (as the executor's
    output thread does). The device from ``VLLM_NEURON_SCHED_DEVICE``."""
    from vllm_neuron_sched.worker.timeline import StepTimeline

    sched = ScriptedScheduler()
    sched.add("a", [3, 1, 4, 1, 5])
    sched.add("b", [9, 2, 6])
    timeline = StepTimeline()
    with (
        toy_runner(is_async=is_async) as runner,
        ThreadPoolExecutor(1, "output") as reader,
    ):
        runner.flow.subscribe(timeline)
        steps = [sched.prefill("a"), sched.prefill("b")]
        steps += [sched.decode("a", "b") for _ in range(num_decodes)]
        unread: list[Any] = []

        def read_oldest() -> None:
            output = unread.pop(0)
            if output_thread:
                reader.submit(read_output, output).result()
            else:
                read_output(output)

        for scheduler_output in steps:
            unread.append(run_step(runner, scheduler_output))
            if len(unread) == 2 or not is_async:
                read_oldest()
        while unread:
            read_oldest()
    return timeline.snapshot(clear=True)


class EngineLoop:
    """Runs scripted steps through the runner the way vLLM's engine loop
    does: each step's output is read once ``depth`` steps are in flight (2:
    the async batch queue; 1: sync), the oldest first. Collects each
    request's tokens, and the requests of steps that failed on the device."""

    def __init__(self, runner: NeuronSchedModelRunner, depth: int) -> None:
        self.runner = runner
        self.depth = depth
        self.tokens: dict[str, list[int]] = {}
        self.failed: dict[str, str] = {}
        # How the flow classed each step that ran, in order.
        self.states = record_step_states(runner)
        self._unread: list[ModelRunnerOutput | AsyncModelRunnerOutput] = []

    def run(self, *steps: SchedulerOutput) -> None:
        for step in steps:
            self._unread.append(run_step(self.runner, step))
            while len(self._unread) >= self.depth:
                self.read_oldest()

    def read_oldest(self) -> ModelRunnerOutput:
        output = read_output(self._unread.pop(0))
        self.failed.update(getattr(output, "failed_req_ids", {}))
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            self.tokens.setdefault(req_id, []).extend(tokens)
        return output

    def flush(self) -> None:
        while self._unread:
            self.read_oldest()
