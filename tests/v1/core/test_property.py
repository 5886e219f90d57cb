"""Random workloads through both engine loops: the run-ahead property (DESIGN 4).

Prefill steps hold groups: each workload declares its static prefill shapes
(the default grid, ``1xCHUNK``, or a few random ones), and every prefill step
must fit one of them.

The same workload (arrivals, EOS and stop tokens at random output indices,
max_tokens, aborts) runs through ``run_sync`` with ``ChunkedPrefillScheduler``
and through ``run_batch_queue`` with ``AsyncChunkedPrefillScheduler``. Both runs
must keep the chunked-prefill invariants and deliver the same tokens. With
pipeline stages (drawn: 1, 2 or 4) both schedulers run the batch queue at the
depth vLLM picks for them: the stages' number, and at least 2 with async
scheduling, so the async scheduler runs up to three steps ahead.

With speculative decoding (``test_speculative_steps_agree``) decode rows
verify drafts and accept a random number of them (a pure function of the
request and the output index, so tokens stay the same); the KV positions a
step reaches must stay within what admission reserved for the request
(``prompt + max_tokens`` and the drafts' lookahead), or the pool runs dry and
vLLM preempts, which the invariants refuse.

Aborts fire at a loop *step index*, and the two loops reach a given point in a
request's life at different step indices (the batch queue schedules ahead), so
an aborted request may legitimately stop at different lengths in the two runs.
The fake runner makes every request's full output a pure function of the
request (token ``i`` depends only on ``(req_id, i)``), so each request has one
*reference* output: its tokens up to and including the first EOS/stop token, or
``max_tokens`` of them. A request that was not aborted must deliver exactly the
reference (and so the same in both loops); an aborted one must deliver a prefix
of it, with no finish reason unless the abort came after it finished.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from vllm_neuron_sched.core.prefill_shapes import fitting_shape
from vllm_neuron_sched.core.scheduler import (
    AsyncChunkedPrefillScheduler,
    ChunkedPrefillScheduler,
)
from vllm_neuron_sched.testing.scheduler_loop import (
    FakeRunner,
    LoopResult,
    build_scheduler,
    interleaving_violations,
    make_request,
    run_batch_queue,
    run_sync,
)

VOCAB = 1024
EOS = VOCAB - 1
STOP = VOCAB - 2
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_EXAMPLES = 200
CASES = {"ran": 0, "grouped_steps": 0, "verify_steps": 0}


@dataclass(frozen=True)
class Spec:
    """One request of a workload; the ``*_index`` fields force output tokens."""

    req_id: str
    prompt_len: int
    max_tokens: int
    arrival: int
    eos_index: int | None
    stop_index: int | None
    abort_step: int | None

    @property
    def volume(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclass(frozen=True)
class Workload:
    specs: tuple[Spec, ...]
    max_num_seqs: int
    chunk_size: int
    num_blocks: int
    # 0: the scheduler's default (max_num_seqs * max_model_len).
    tkv_limit: int
    # VLLM_NEURON_SCHED_PREFILL_SHAPES ("" = the default grid).
    prefill_shapes: str = ""
    # Speculative decoding: drafts per verify row (0: off), and whether a
    # draft model proposes (its KV reaches K past the verify step).
    num_spec_tokens: int = 0
    draft_model: bool = False
    # Pipeline stages: the batch queue's depth vLLM picks for them, for both
    # schedulers (async: 2 with one stage; sync: no queue with one stage).
    pipeline_stages: int = 1

    @property
    def sync_depth(self) -> int:
        return self.pipeline_stages

    @property
    def async_depth(self) -> int:
        return max(2, self.pipeline_stages)

    def forced(self) -> dict[tuple[str, int], int]:
        forced = {}
        for spec in self.specs:
            if spec.stop_index is not None:
                forced[(spec.req_id, spec.stop_index)] = STOP
            if spec.eos_index is not None:
                forced[(spec.req_id, spec.eos_index)] = EOS
        return forced


class Events:
    """Adds each request at its arrival step and aborts it at its abort step."""

    def __init__(self, workload: Workload) -> None:
        self.specs = workload.specs
        steps = [s.arrival for s in self.specs]
        steps += [s.abort_step for s in self.specs if s.abort_step is not None]
        self.last_step = max(steps)

    def __call__(self, step: int, scheduler: Scheduler) -> None:
        for spec in self.specs:
            if spec.arrival == step:
                scheduler.add_request(
                    make_request(
                        spec.req_id,
                        spec.prompt_len,
                        spec.max_tokens,
                        eos_token_id=EOS,
                        stop_token_ids=[STOP],
                        vocab_size=VOCAB,
                    )
                )
            if spec.abort_step == step:
                scheduler.finish_requests(spec.req_id, RequestStatus.FINISHED_ABORTED)


class CheckingRunner(FakeRunner):
    """Keeps every ``SchedulerOutput`` so invariants can be checked after the
    run, and every request that holds more KV blocks than admission reserved
    for it (vLLM allocates a draft model's lookahead past the scheduled
    tokens: a reserve that leaves it out is overdrawn)."""

    def __init__(
        self, forced: dict[tuple[str, int], int], num_spec_tokens: int = 0
    ) -> None:
        super().__init__(VOCAB, forced=forced, num_spec_tokens=num_spec_tokens)
        self.outputs: list[SchedulerOutput] = []
        self.overdrawn: list[tuple[int, str, int, int]] = []

    def execute(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        self.outputs.append(so)
        for req_id in so.num_scheduled_tokens:
            groups = scheduler.kv_cache_manager.get_block_ids(req_id)
            needed = scheduler.blocks_needed(scheduler.requests[req_id])
            for blocks, reserved in zip(groups, needed):
                if len(blocks) > reserved:
                    step = len(self.outputs) - 1
                    self.overdrawn.append((step, req_id, len(blocks), reserved))
        return super().execute(so, scheduler)


@st.composite
def workloads(draw: st.DrawFn, speculative: bool = False) -> Workload:
    num_spec_tokens = draw(st.integers(1, 4)) if speculative else 0
    draft_model = speculative and draw(st.booleans())
    num_requests = draw(st.integers(1, 12))
    specs = []
    for i in range(num_requests):
        prompt_len = draw(st.integers(1, 100))
        max_tokens = draw(st.integers(1, 40))
        if speculative and draw(st.booleans()):
            # prompt + max_tokens (+ some drafts) ends a block: a draft past
            # it needs one more.
            shift = draw(st.integers(0, 3)) * num_spec_tokens
            max_tokens += -(prompt_len + max_tokens + shift) % BLOCK_SIZE
        arrival = draw(st.integers(0, 20) | st.just(0))  # bursts: groups
        output_index = st.none() | st.integers(0, max_tokens - 1)
        abort_after = draw(st.none() | st.integers(0, 40))
        specs.append(
            Spec(
                req_id=f"r{i}",
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                arrival=arrival,
                eos_index=draw(output_index),
                stop_index=draw(output_index),
                abort_step=None if abort_after is None else arrival + abort_after,
            )
        )
    max_num_seqs = draw(st.integers(1, 6))
    chunk_size = draw(st.integers(max(8, max_num_seqs), 64))
    largest = max(s.volume for s in specs)
    # Often tight, so that admission has to wait for blocks and for tkv room.
    extra_blocks = draw(st.integers(0, 4) | st.integers(0, 24))
    if speculative:
        extra_blocks = draw(st.just(0) | st.integers(0, 4))
    # Room for the largest request with its drafts' lookahead (both loops).
    largest += (2 + draft_model) * num_spec_tokens
    num_blocks = cdiv(largest, BLOCK_SIZE) + 1 + extra_blocks
    tkv_limit = draw(st.just(0) | st.integers(largest, 2 * largest))
    # Speculative decoding refuses pipeline stages.
    stages = 1 if speculative else draw(st.sampled_from([1, 1, 2, 4]))
    shapes = draw(st.sampled_from(["", f"1x{chunk_size}", "random"]))
    if shapes == "random":
        # A row holds a one-token rest padded with placeholder drafts.
        fewest = 1 + num_spec_tokens
        grid = set()
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):  # packed: any number of requests in a row
                grid.add(f"p{draw(st.integers(fewest, chunk_size))}")
                continue
            rows = draw(st.integers(1, min(max_num_seqs, chunk_size // fewest)))
            grid.add(f"{rows}x{draw(st.integers(fewest, chunk_size // rows))}")
        shapes = ",".join(sorted(grid))
    return Workload(
        tuple(specs),
        max_num_seqs,
        chunk_size,
        num_blocks,
        tkv_limit,
        shapes,
        num_spec_tokens,
        draft_model,
        stages,
    )


def reference_output(spec: Spec, runner: FakeRunner) -> tuple[list[int], str]:
    """Tokens and finish reason of ``spec`` when nothing aborts it."""
    tokens = []
    for i in range(spec.max_tokens):
        tokens.append(runner.token(spec.req_id, i))
        if tokens[-1] in (EOS, STOP):
            return tokens, "stop"
    return tokens, "length"


def run_workload(
    workload: Workload, scheduler_cls: type[Scheduler], model_dir: str
) -> tuple[LoopResult, CheckingRunner, Scheduler]:
    # The scheduler reads the limit from the environment when it is built.
    os.environ["VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT"] = str(workload.tkv_limit)
    os.environ["VLLM_NEURON_SCHED_PREFILL_SHAPES"] = workload.prefill_shapes
    is_async = scheduler_cls is AsyncChunkedPrefillScheduler
    scheduler = build_scheduler(
        scheduler_cls,
        model_dir,
        async_scheduling=is_async,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.chunk_size,
        num_blocks=workload.num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_spec_tokens=workload.num_spec_tokens,
        draft_model=workload.draft_model,
    )
    runner = CheckingRunner(workload.forced(), workload.num_spec_tokens)
    depth = workload.async_depth if is_async else workload.sync_depth
    events = Events(workload)
    if depth == 1:
        return run_sync(scheduler, runner, events), runner, scheduler
    return run_batch_queue(scheduler, runner, events, depth), runner, scheduler


def check_invariants(
    workload: Workload, result: LoopResult, runner: CheckingRunner, scheduler: Scheduler
) -> None:
    specs = {s.req_id: s for s in workload.specs}
    tkv_limit = scheduler.limits.max_batch_tkv_limit
    if workload.tkv_limit:
        assert tkv_limit == workload.tkv_limit
    num_usable_blocks = workload.num_blocks - 1  # minus the null block
    for i, (step, so) in enumerate(zip(runner.steps, runner.outputs)):
        where = f"step {i}: {step}"
        kinds = set(step.is_prefill.values())
        assert len(kinds) <= 1, f"mixed prefill and decode at {where}"
        if kinds == {True}:
            chunks = [n for _, n in step.scheduled.values()]
            shape = fitting_shape(chunks, scheduler.prefill_shapes)
            assert shape is not None, f"prefill step fits no shape at {where}"
            CASES["grouped_steps"] += len(chunks) > 1
        assert len(step.scheduled) <= workload.max_num_seqs, where
        assert step.num_running <= workload.max_num_seqs, where
        assert step.num_free_blocks <= num_usable_blocks, f"double free at {where}"
        assert not so.scheduled_cached_reqs.resumed_req_ids, f"preempted at {where}"
        # Async: the step before may still hold its drafts unretired.
        is_async = isinstance(scheduler, AsyncChunkedPrefillScheduler)
        depth = workload.async_depth if is_async else workload.sync_depth
        lookahead = depth * workload.num_spec_tokens
        for req_id, (start, num_tokens) in step.scheduled.items():
            spec = specs[req_id]
            reach = spec.volume - 1 + lookahead
            assert start + num_tokens <= reach, f"past the reserve at {where}"
            CASES["verify_steps"] += bool(so.scheduled_spec_decode_tokens.get(req_id))
        if kinds == {False}:
            max_position = max(start + n for start, n in step.scheduled.values())
            assert len(step.scheduled) * max_position <= tkv_limit, where
    assert not runner.overdrawn, (
        f"(step, request, blocks, reserved): {runner.overdrawn}"
    )
    # A prefill right after a prefill while a decode could run (a sync
    # scheduler's decodes in a batch queue wait for their outputs).
    violations = [
        i
        for i in interleaving_violations([step.is_prefill for step in runner.steps])
        if runner.steps[i].ready_decodes
    ]
    assert violations == [], f"prefill steps {violations} follow a prefill"
    block_pool = scheduler.kv_cache_manager.block_pool
    assert block_pool.get_num_free_blocks() == num_usable_blocks, "blocks leaked"
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting

    for req_id, spec in specs.items():
        tokens, reason = reference_output(spec, runner)
        delivered = result.tokens.get(req_id, [])
        assert len(delivered) <= spec.max_tokens
        if spec.abort_step is None or req_id in result.finish_reasons:
            assert delivered == tokens, req_id
            assert result.finish_reasons[req_id] == reason, req_id
        else:
            assert delivered == tokens[: len(delivered)], req_id


def check_both_loops(workload: Workload, checkpoint_dir: str) -> None:
    """Invariants hold in both loops, and both deliver the same outputs."""
    sync = run_workload(workload, ChunkedPrefillScheduler, checkpoint_dir)
    batch_queue = run_workload(workload, AsyncChunkedPrefillScheduler, checkpoint_dir)
    check_invariants(workload, *sync)
    check_invariants(workload, *batch_queue)
    for spec in workload.specs:
        if spec.abort_step is None:
            req_id = spec.req_id
            assert sync[0].tokens[req_id] == batch_queue[0].tokens[req_id]
            assert (
                sync[0].finish_reasons[req_id] == batch_queue[0].finish_reasons[req_id]
            )


@pytest.fixture(scope="module")
def case_counter() -> Iterator[dict[str, int]]:
    """Reports how many generated workloads ran (each through both loops)."""
    CASES.update(ran=0, grouped_steps=0, verify_steps=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "0")  # restored after
        mp.setenv("VLLM_NEURON_SCHED_PREFILL_SHAPES", "")
        yield CASES
    print(
        f"\nhypothesis: {CASES['ran']} workloads, each through both loops; "
        f"{CASES['grouped_steps']} prefill steps held several requests, "
        f"{CASES['verify_steps']} rows verified drafts"
    )
    assert CASES["ran"] > 0 and CASES["grouped_steps"] > 0


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(workload=workloads())
def test_sync_and_batch_queue_agree(
    workload: Workload, checkpoint_dir: str, case_counter: dict[str, int]
) -> None:
    """Invariants hold in both loops, and both loops deliver the same outputs."""
    case_counter["ran"] += 1
    check_both_loops(workload, checkpoint_dir)


@settings(
    max_examples=MAX_EXAMPLES // 4,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(workload=workloads(speculative=True))
def test_speculative_steps_agree(
    workload: Workload, checkpoint_dir: str, case_counter: dict[str, int]
) -> None:
    """Verify steps with random acceptance: the invariants hold in both loops
    (admission reserves the drafts' lookahead: no preemption, no leak, no
    position past the reserve, the tkv limit kept) and both deliver the same
    outputs."""
    case_counter["ran"] += 1
    check_both_loops(workload, checkpoint_dir)
