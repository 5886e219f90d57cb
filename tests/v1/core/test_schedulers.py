"""The schedulers' policies, driven through both engine loops with a fake runner.

Sync runs are ``run_sync`` (``EngineCore.step()``); async runs are
``run_batch_queue`` (step N+1 scheduled before step N's update), so every
policy is checked against the run-ahead the async engine really does.
"""

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from vllm.pooling_params import PoolingParams
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_neuron_sched.core.errors import FailedStepOutput
from vllm_neuron_sched.core.pooling import PoolingMixin
from vllm_neuron_sched.core.prefill_shapes import fitting_shape
from vllm_neuron_sched.core.scheduler import (
    AsyncChunkedPrefillScheduler,
    ChunkedPrefillScheduler,
    PoolingScheduler,
)
from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.testing.scheduler_loop import (
    FakeRunner,
    LoopResult,
    StepRecord,
    build_scheduler,
    fake_token,
    make_request,
    run_batch_queue,
    run_sync,
)
from vllm_neuron_sched.testing.scheduler_loop import (
    interleaving_violations as prefill_after_prefill,
)

VOCAB = 1024
EOS = VOCAB - 1
Loop = Callable[..., LoopResult]


@dataclass(frozen=True)
class Mode:
    """A scheduler class, its config flag and the engine loop that drives it."""

    cls: type[Scheduler]
    is_async: bool
    loop: Loop


SYNC = Mode(ChunkedPrefillScheduler, False, run_sync)
ASYNC = Mode(AsyncChunkedPrefillScheduler, True, run_batch_queue)
MODES = pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])


class _AsyncPooling(PoolingMixin, AsyncScheduler):
    """The pooling policy over the async base, to show it is loop-independent."""


class RecordingRunner(FakeRunner):
    """Also keeps each ``SchedulerOutput`` and the scheduler's ``tkv`` after it."""

    def __init__(self, vocab_size: int = VOCAB, **kwargs) -> None:
        super().__init__(vocab_size, **kwargs)
        self.outputs: list[SchedulerOutput] = []
        self.tkvs: list[int] = []

    def execute(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        self.outputs.append(so)
        self.tkvs.append(getattr(scheduler, "decode_tkv", lambda: 0)())
        return super().execute(so, scheduler)


@dataclass
class Events:
    """Adds requests and aborts them at fixed loop steps."""

    arrivals: dict[int, list[Request]] = field(default_factory=dict)
    aborts: dict[int, list[str]] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max([*self.arrivals, *self.aborts], default=-1)

    def __call__(self, step: int, scheduler: Scheduler) -> None:
        for request in self.arrivals.get(step, []):
            scheduler.add_request(request)
        for req_id in self.aborts.get(step, []):
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


def arrive(*requests: tuple[int, Request]) -> Events:
    events = Events()
    for step, request in requests:
        events.arrivals.setdefault(step, []).append(request)
    return events


def run(
    mode: Mode,
    model_dir: str,
    events: Events,
    runner: RecordingRunner | None = None,
    **kw,
) -> tuple[Scheduler, RecordingRunner, LoopResult]:
    scheduler = build_scheduler(
        mode.cls, model_dir, async_scheduling=mode.is_async, **kw
    )
    runner = runner or RecordingRunner()
    return scheduler, runner, mode.loop(scheduler, runner, events)


def req(req_id: str, prompt_len: int, max_tokens: int, **kw) -> Request:
    return make_request(req_id, prompt_len, max_tokens, vocab_size=VOCAB, **kw)


def step_kind(step: StepRecord) -> str:
    """'prefill', 'decode', 'idle', or 'mixed' (a broken step)."""
    return BatchShape.of(step.is_prefill.values()).value


def step_kinds(runner: FakeRunner) -> list[str]:
    return [step_kind(step) for step in runner.steps]


def steps_of(runner: FakeRunner, req_id: str) -> list[int]:
    return [i for i, s in enumerate(runner.steps) if req_id in s.scheduled]


def interleaving_violations(runner: FakeRunner) -> list[int]:
    return prefill_after_prefill([step.is_prefill for step in runner.steps])


def assert_blocks_all_free(scheduler: Scheduler, runner: FakeRunner) -> None:
    """Never more free blocks than exist (double free), all free at the end."""
    num_usable = scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    assert all(s.num_free_blocks <= num_usable for s in runner.steps)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_usable
    assert not scheduler.requests


def expected_tokens(req_id: str, max_tokens: int, runner: FakeRunner) -> list[int]:
    return [runner.token(req_id, i) for i in range(max_tokens)]


def assert_all_ran_unpreempted(
    scheduler: Scheduler,
    runner: RecordingRunner,
    result: LoopResult,
    max_tokens: dict[str, int],
) -> None:
    """Nothing was preempted, every request got all its tokens, and every
    block came back."""
    for so in runner.outputs:
        assert not so.scheduled_cached_reqs.resumed_req_ids, "preemption happened"
    for req_id, n in max_tokens.items():
        assert result.tokens[req_id] == expected_tokens(req_id, n, runner)
    assert_blocks_all_free(scheduler, runner)


# --- async mode is a config fact ---------------------------------------------


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("cls", [ChunkedPrefillScheduler, AsyncChunkedPrefillScheduler])
def test_platform_keeps_the_async_flag_and_picks_the_class_from_it(
    checkpoint_dir: str, cls: type[Scheduler], flag: bool
) -> None:
    """vLLM's CPU platform forces async off; ours keeps the user's choice."""
    scheduler = build_scheduler(cls, checkpoint_dir, async_scheduling=flag)
    scheduler_config = scheduler.vllm_config.scheduler_config
    assert scheduler_config.async_scheduling is flag
    # The platform ran (it picks our class from the flag) and did not flip it.
    expected = "AsyncChunkedPrefillScheduler" if flag else "ChunkedPrefillScheduler"
    assert str(scheduler_config.scheduler_cls).rsplit(".", 1)[-1] == expected


def test_platform_turns_async_off_for_pooling(checkpoint_dir: str) -> None:
    """Pooling is sync only, whatever the user asked (docs/design.md)."""
    scheduler = build_scheduler(
        PoolingScheduler, checkpoint_dir, async_scheduling=True, runner="pooling"
    )
    assert scheduler.vllm_config.scheduler_config.async_scheduling is False


# --- chunked-prefill rules ----------------------------------------------------


@MODES
@pytest.mark.parametrize(
    "shapes",
    ["", "1x16,1x32,2x16", "1x32"],
    ids=["default-packed", "rectangular", "1xchunk"],
)
def test_step_shape_rules(
    mode: Mode, shapes: str, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No mixed step; every prefill step fits a declared shape (packed rows
    by default, rectangular ones declared) and holds the ongoing prefills
    before any new request; seqs cap. With ``1xCHUNK`` (the anchors' rule) a
    prefill step is one request and one prefill is ongoing."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_PREFILL_SHAPES", shapes)
    prompts = [100, 20, 50, 5, 70, 33, 64]
    events = arrive(*((i // 2, req(f"r{i}", p, 6 + i)) for i, p in enumerate(prompts)))
    scheduler, runner, result = run(mode, checkpoint_dir, events, max_num_seqs=3)

    kinds = step_kinds(runner)
    assert "mixed" not in kinds
    assert "prefill" in kinds and "decode" in kinds
    partial: set[str] = set()  # between their first and last prompt chunk
    num_rows = []
    for kind, step in zip(kinds, runner.steps):
        assert step.num_running <= 3
        assert len(step.scheduled) <= 3
        if kind == "prefill":
            chunks = [n for _, n in step.scheduled.values()]
            assert fitting_shape(chunks, scheduler.prefill_shapes), step
            num_rows.append(len(chunks))
            if any(start == 0 for start, _ in step.scheduled.values()):
                assert partial <= step.scheduled.keys(), "a new request jumped ahead"
        for req_id, (start, num_tokens) in step.scheduled.items():
            prompt_len = runner.prompt_lens[req_id]
            if start < prompt_len:
                partial.discard(req_id)
                if start + num_tokens < prompt_len:
                    partial.add(req_id)
        if shapes == "1x32":
            assert len(partial) <= 1
    assert (max(num_rows) > 1) == (shapes != "1x32")
    assert interleaving_violations(runner) == []
    for i in range(len(prompts)):
        assert result.tokens[f"r{i}"] == expected_tokens(f"r{i}", 6 + i, runner)
        assert result.finish_reasons[f"r{i}"] == "length"
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_ongoing_prefill_beats_new_request(mode: Mode, checkpoint_dir: str) -> None:
    """A newer request never takes the long prompt's place: until its last
    chunk, every prefill step runs a chunk of it (the newer one may share
    the step in a row of its own)."""
    events = arrive((0, req("long", 120, 4)), (1, req("short", 8, 4)))
    _, runner, _ = run(mode, checkpoint_dir, events, max_num_batched_tokens=32)
    prefills = [
        set(step.scheduled)
        for kind, step in zip(step_kinds(runner), runner.steps)
        if kind == "prefill"
    ]
    long_steps = [i for i, held in enumerate(prefills) if "long" in held]
    assert long_steps == list(range(len(long_steps)))
    assert any("short" in held for held in prefills)


@MODES
@pytest.mark.parametrize("interleave", [True, False])
def test_prefill_interleaving(
    mode: Mode, interleave: bool, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With decodes running, interleaving forbids back-to-back prefill steps."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_PREFILL_INTERLEAVING", str(int(interleave)))
    events = arrive((0, req("dec", 8, 30)), (2, req("long", 128, 4)))
    _, runner, result = run(mode, checkpoint_dir, events, max_num_batched_tokens=32)
    long_steps = steps_of(runner, "long")
    dec_steps = steps_of(runner, "dec")
    assert min(dec_steps) < min(long_steps) and max(long_steps) < max(dec_steps)
    violations = interleaving_violations(runner)
    if interleave:
        assert violations == []
    else:
        # The four chunks of "long" run back to back while "dec" waits.
        assert len(violations) == 3
    assert result.tokens["dec"] == expected_tokens("dec", 30, runner)


@MODES
@pytest.mark.parametrize("tkv_limit", [100, 0], ids=["limit100", "nolimit"])
def test_tkv_limit_gates_admission(
    mode: Mode, tkv_limit: int, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 40+20 requests cannot share a batch under a 100-token volume."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", str(tkv_limit))
    events = arrive((0, req("a", 40, 20)), (1, req("b", 40, 20)))
    scheduler, runner, result = run(mode, checkpoint_dir, events)
    if tkv_limit:
        assert scheduler.limits.max_batch_tkv_limit == tkv_limit
        assert min(steps_of(runner, "b")) > max(steps_of(runner, "a"))
    else:
        assert min(steps_of(runner, "b")) < max(steps_of(runner, "a"))
    limit = scheduler.limits.max_batch_tkv_limit
    for kind, step, tkv in zip(step_kinds(runner), runner.steps, runner.tkvs):
        if kind == "decode":
            # tkv covers the largest position the step reaches.
            max_position = max(start + n for start, n in step.scheduled.values())
            assert tkv >= max_position
            assert len(step.scheduled) * max_position <= limit
    assert result.tokens["b"] == expected_tokens("b", 20, runner)


@MODES
def test_blocks_reserved_for_prompt_and_max_tokens(
    mode: Mode, checkpoint_dir: str
) -> None:
    """The second request's prompt fits in the free blocks, its lifetime does not."""
    block_size, num_blocks = 16, 7  # 6 usable: one 20+40 request needs 4.
    events = arrive((0, req("a", 20, 40)), (1, req("b", 20, 40)))
    scheduler, runner, result = run(
        mode, checkpoint_dir, events, num_blocks=num_blocks, block_size=block_size
    )
    first_b = min(steps_of(runner, "b"))
    assert first_b > max(steps_of(runner, "a"))
    waiting_steps = runner.steps[2:first_b]
    assert waiting_steps, "b never had to wait"
    assert min(s.num_free_blocks for s in waiting_steps) >= cdiv(20, block_size)
    assert_all_ran_unpreempted(scheduler, runner, result, {"a": 40, "b": 40})


@MODES
def test_blocks_reserved_in_every_kv_cache_group(
    mode: Mode, checkpoint_dir: str
) -> None:
    """A hybrid model's full-attention and sliding-window layers take blocks
    from one pool, a group each: a 20+40 request needs 4 in each. With 9
    usable blocks the second waits for the first, and nothing is preempted
    or stalls (counting one group, both started together, and vLLM could
    not grow them)."""
    events = arrive((0, req("a", 20, 40)), (0, req("b", 20, 40)))
    scheduler, runner, result = run(
        mode,
        checkpoint_dir,
        events,
        num_blocks=10,
        block_size=16,
        sliding_window=32,
    )
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    assert min(steps_of(runner, "b")) > max(steps_of(runner, "a"))
    assert_all_ran_unpreempted(scheduler, runner, result, {"a": 40, "b": 40})


@MODES
def test_a_declined_prefill_step_lets_the_decodes_run(
    mode: Mode, checkpoint_dir: str
) -> None:
    """Were vLLM's scheduler to decline a planned prefill step (KV blocks
    admission did not foresee), the decodes go on; the prefill follows."""
    scheduler = build_scheduler(
        mode.cls, checkpoint_dir, async_scheduling=mode.is_async
    )
    manager = scheduler.kv_cache_manager
    allocate = manager.allocate_slots
    declined: list[str] = []

    def allocate_once_short(request: Request, *args, **kwargs):
        if request.request_id == "b" and not declined:
            declined.append(request.request_id)
            return None  # no room, this once
        return allocate(request, *args, **kwargs)

    manager.allocate_slots = allocate_once_short
    runner = RecordingRunner()
    events = arrive((0, req("a", 8, 12)), (3, req("b", 8, 12)))
    result = mode.loop(scheduler, runner, events)
    assert declined == ["b"]
    kinds = step_kinds(runner)
    assert kinds[kinds.index("idle") + 1] == "decode"
    for req_id in "ab":
        assert result.tokens[req_id] == expected_tokens(req_id, 12, runner)


@MODES
def test_a_group_is_admitted_only_as_far_as_every_member_fits(
    mode: Mode, checkpoint_dir: str
) -> None:
    """Three 16+48 requests at once, KV blocks for two lifetimes (4 blocks
    each, 8 usable): the first prefill step holds two, the third starts once
    blocks come back, and nothing is ever preempted."""
    events = arrive(*((0, req(f"r{i}", 16, 48)) for i in range(3)))
    scheduler, runner, result = run(
        mode,
        checkpoint_dir,
        events,
        num_blocks=9,
        block_size=16,
        max_num_batched_tokens=64,  # shapes of up to 4 rows
    )
    assert max(shape.max_requests for shape in scheduler.prefill_shapes) >= 3
    first = runner.steps[0].scheduled
    assert sorted(first) == ["r0", "r1"]
    assert min(steps_of(runner, "r2")) > min(
        max(steps_of(runner, "r0")), max(steps_of(runner, "r1"))
    )
    assert_all_ran_unpreempted(
        scheduler, runner, result, {f"r{i}": 48 for i in range(3)}
    )


@MODES
def test_a_group_keeps_the_tkv_limit_for_the_batch_it_joins(
    mode: Mode, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a 150-token volume, two 40+20 requests may decode together
    (2 x 60) but not three (3 x 60): a burst of three prefills two."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "150")
    events = arrive(*((0, req(f"r{i}", 40, 20)) for i in range(3)))
    scheduler, runner, result = run(
        mode, checkpoint_dir, events, max_num_batched_tokens=128
    )
    first_prefill = next(s for s in runner.steps if s.is_prefill.get("r0"))
    assert "r2" not in first_prefill.scheduled and "r1" in first_prefill.scheduled
    for kind, step in zip(step_kinds(runner), runner.steps):
        if kind == "decode":
            max_position = max(start + n for start, n in step.scheduled.values())
            assert len(step.scheduled) * max_position <= 150
    for i in range(3):
        assert result.tokens[f"r{i}"] == expected_tokens(f"r{i}", 20, runner)


@MODES
def test_request_that_can_never_fit_is_finished_with_error(
    mode: Mode, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prompt + max_tokens over the tkv limit: an error output, others served."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "100")
    scheduler = build_scheduler(
        mode.cls, checkpoint_dir, async_scheduling=mode.is_async
    )
    runner = RecordingRunner()
    scheduler.add_request(req("ok", 30, 5))
    scheduler.add_request(req("huge", 60, 50))
    scheduler.add_request(req("ok2", 30, 5))

    so = scheduler.schedule()
    first = LoopResult()
    first.collect(scheduler.update_from_output(so, runner.execute(so, scheduler)))
    assert "huge" not in so.num_scheduled_tokens
    assert first.finish_reasons == {"huge": "error"}
    assert first.tokens["huge"] == []

    result = mode.loop(scheduler, runner, Events())
    assert "huge" not in result.tokens
    for req_id in ("ok", "ok2"):
        tokens = first.tokens.get(req_id, []) + result.tokens[req_id]
        assert tokens == expected_tokens(req_id, 5, runner)
        assert result.finish_reasons[req_id] == "length"
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_bad_words_beyond_the_compiled_shape_are_finished_with_error(
    mode: Mode, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled device lays bad words out at vLLM's per-request token
    limit: a request past it gets an error naming the limit, and a request
    within it is served."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "compiled")
    monkeypatch.setenv("VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "4")
    scheduler = build_scheduler(
        mode.cls, checkpoint_dir, async_scheduling=mode.is_async
    )
    fits, too_many = req("fits", 10, 3), req("too_many", 10, 3)
    # As the engine core receives them: tokenized by vLLM's input processor.
    fits.sampling_params._bad_words_token_ids = [[1, 2], [3, 4]]
    too_many.sampling_params._bad_words_token_ids = [[1, 2], [3, 4, 5]]
    scheduler.add_request(fits)
    scheduler.add_request(too_many)
    so = scheduler.schedule()
    first = LoopResult()
    first.collect(
        scheduler.update_from_output(so, RecordingRunner().execute(so, scheduler))
    )
    assert first.finish_reasons == {"too_many": "error"}
    assert "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS" in scheduler.limits.check_sampling(
        too_many.sampling_params
    )
    assert "fits" in so.num_scheduled_tokens


@MODES
def test_rejection_reaches_client_on_idle_engine(
    mode: Mode, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing else to run, the loop still steps once to deliver the error."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "100")
    _, _, result = run(mode, checkpoint_dir, arrive((0, req("huge", 60, 50))))
    assert result.finish_reasons == {"huge": "error"}


# --- device failures ------------------------------------------------------------


class FailingRunner(RecordingRunner):
    """Fails, once, the first step ``should_fail`` picks: no token for any of
    its rows, and the step's requests reported, as our runner does."""

    def __init__(
        self, should_fail: Callable[[StepRecord, Scheduler], bool], **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.should_fail = should_fail
        self.failed_step: SchedulerOutput | None = None

    def execute(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        output = super().execute(so, scheduler)
        if self.failed_step is not None or not self.should_fail(
            self.steps[-1], scheduler
        ):
            return output
        self.failed_step = so
        return FailedStepOutput(
            req_ids=output.req_ids,
            req_id_to_index=output.req_id_to_index,
            sampled_token_ids=[[] for _ in output.req_ids],
            failed_req_ids=dict.fromkeys(output.req_ids, "RuntimeError('boom')"),
        )


def runs(req_id: str) -> Callable[[StepRecord, Scheduler], bool]:
    return lambda step, _: req_id in step.scheduled


@MODES
def test_a_failed_step_finishes_its_requests_and_serves_the_rest(
    mode: Mode, checkpoint_dir: str
) -> None:
    """The victim's first prompt chunk fails: the victim ends with an error
    and no token; the others get every token; every block comes back."""
    runner = FailingRunner(runs("victim"))
    events = arrive((0, req("a", 24, 12)), (3, req("victim", 40, 12)))
    events.arrivals[6] = [req("b", 24, 12)]
    scheduler, _, result = run(mode, checkpoint_dir, events, runner=runner)
    assert runner.failed_step is not None
    assert set(runner.failed_step.num_scheduled_tokens) == {"victim"}
    assert result.finish_reasons["victim"] == "error"
    assert result.tokens["victim"] == []
    for req_id in ("a", "b"):
        assert result.tokens[req_id] == expected_tokens(req_id, 12, runner)
        assert result.finish_reasons[req_id] == "length"
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_a_failed_prompt_chunk_leaves_the_prefix_cache(
    mode: Mode, checkpoint_dir: str
) -> None:
    """vLLM registers a chunk's blocks in the prefix cache when it schedules
    the chunk: after the chunk failed, the same prompt must compute them
    again, not hit blocks that were never written."""
    prompt = [fake_token("p", i, VOCAB) for i in range(48)]

    def same_prompt(req_id: str) -> Request:
        return make_request(req_id, 48, 4, prompt=prompt, block_size=16)

    runner = FailingRunner(runs("victim"))
    events = arrive((0, same_prompt("victim")))
    events.arrivals[8] = [same_prompt("again")]
    scheduler, _, result = run(
        mode, checkpoint_dir, events, runner=runner, enable_prefix_caching=True
    )
    assert result.finish_reasons == {"victim": "error", "again": "length"}
    again = [s.scheduled["again"] for s in runner.steps if "again" in s.scheduled]
    assert again[0][0] == 0, f"prefix hit on failed blocks: {again}"
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_a_failed_chunk_of_an_aborted_request_leaves_the_prefix_cache(
    mode: Mode, checkpoint_dir: str
) -> None:
    """The victim's client goes away while its first prompt chunk is on the
    device (the engine applies the abort before it reads the step), and the
    chunk fails: the blocks it was to fill, which vLLM registered when it
    scheduled it and freed with the abort, must not serve a later hit."""
    prompt = [fake_token("p", i, VOCAB) for i in range(48)]

    def same_prompt(req_id: str) -> Request:
        return make_request(req_id, 48, 4, prompt=prompt, block_size=16)

    class AbortingRunner(FailingRunner):
        def execute(self, so: SchedulerOutput, scheduler: Scheduler):
            output = super().execute(so, scheduler)
            if self.failed_step is so:
                scheduler.finish_requests("victim", RequestStatus.FINISHED_ABORTED)
            return output

    runner = AbortingRunner(runs("victim"))
    events = arrive((0, same_prompt("victim")))
    events.arrivals[8] = [same_prompt("again")]
    scheduler, _, result = run(
        mode, checkpoint_dir, events, runner=runner, enable_prefix_caching=True
    )
    assert runner.failed_step is not None
    assert result.finish_reasons["again"] == "length"
    again = [s.scheduled["again"] for s in runner.steps if "again" in s.scheduled]
    assert again[0][0] == 0, f"prefix hit on failed blocks: {again}"
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_a_request_sharing_only_written_blocks_survives(
    mode: Mode, checkpoint_dir: str
) -> None:
    """The owner's decode step fails while the sharer, which hit the owner's
    two prompt blocks in the prefix cache, is between its own prompt chunks:
    that step wrote nothing into the shared blocks, so the sharer runs on."""
    prompt = [fake_token("p", i, VOCAB) for i in range(100)]
    owner = make_request("owner", 33, 12, prompt=prompt[:33], block_size=16)
    sharer = make_request("sharer", 100, 12, prompt=prompt, block_size=16)

    def owner_alone_while_sharer_prefills(step: StepRecord, scheduler) -> bool:
        other = scheduler.requests.get("sharer")
        return (
            "owner" in step.scheduled
            and "sharer" not in step.scheduled
            and other is not None
            and 0 < other.num_computed_tokens < other.num_prompt_tokens
        )

    runner = FailingRunner(owner_alone_while_sharer_prefills)
    events = arrive((0, owner), (3, sharer))
    scheduler, _, result = run(
        mode, checkpoint_dir, events, runner=runner, enable_prefix_caching=True
    )
    first = next(s.scheduled["sharer"] for s in runner.steps if "sharer" in s.scheduled)
    assert first[0] == 32, "the sharer should hit the owner's two prompt blocks"
    assert runner.failed_step is not None
    assert result.finish_reasons["owner"] == "error"
    assert result.finish_reasons["sharer"] == "length"
    assert result.tokens["sharer"] == expected_tokens("sharer", 12, runner)
    assert_blocks_all_free(scheduler, runner)


# --- pooling ------------------------------------------------------------------

POOLING_SHAPES = "16x2,48x1"


def pooling_req(req_id: str, prompt_len: int) -> Request:
    prompt = list(range(1, prompt_len + 1))
    return Request(req_id, prompt, None, PoolingParams())


@pytest.mark.parametrize(
    ("cls", "loop"),
    [(PoolingScheduler, run_sync), (_AsyncPooling, run_batch_queue)],
    ids=["sync", "async"],
)
def test_pooling_static_shape_batches(
    cls: type[Scheduler],
    loop: Loop,
    checkpoint_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches are arrival-order runs that fit one shape, one batch at a time."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_POOLING_SHAPES", POOLING_SHAPES)
    scheduler = build_scheduler(
        cls,
        checkpoint_dir,
        async_scheduling=cls is _AsyncPooling,
        runner="pooling",
        max_num_batched_tokens=64,
    )
    assert scheduler.limits.pooling_shapes is not None
    prompts = {"a": 10, "b": 12, "c": 40, "d": 8, "e": 14, "f": 5}
    events = arrive(
        *((0, pooling_req(r, n)) for r, n in prompts.items() if r != "f"),
        (0, pooling_req("too_long", 60)),
        (2, pooling_req("f", prompts["f"])),
    )
    runner = RecordingRunner()
    result = loop(scheduler, runner, events)

    batches = [sorted(s.scheduled) for s in runner.steps if s.scheduled]
    assert batches == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    for step in runner.steps:
        if step.scheduled:
            # Nothing else runs while a batch starts.
            assert step.num_running == len(step.scheduled)
            longest = max(runner.prompt_lens[r] for r in step.scheduled)
            assert scheduler.limits.fits_pooling_shape(longest, len(step.scheduled))
            assert all(start == 0 for start, _ in step.scheduled.values())
    assert result.finish_reasons == {
        **dict.fromkeys(prompts, "stop"),
        "too_long": "error",
    }
    assert_blocks_all_free(scheduler, runner)


def test_pooling_prompt_over_step_budget_is_rejected(
    checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt that fits a shape but not one step's token budget can never run.

    Pooling prompts are never chunked, so such a request used to sit at the head
    of the queue forever and stall everything behind it.
    """
    monkeypatch.setenv("VLLM_NEURON_SCHED_POOLING_SHAPES", POOLING_SHAPES)
    scheduler = build_scheduler(
        PoolingScheduler,
        checkpoint_dir,
        async_scheduling=False,
        runner="pooling",
        max_num_batched_tokens=32,
    )
    events = arrive((0, pooling_req("over_budget", 40)), (0, pooling_req("a", 10)))
    runner = RecordingRunner()
    result = run_sync(scheduler, runner, events, max_steps=100)
    assert result.finish_reasons == {"over_budget": "error", "a": "stop"}
    assert_blocks_all_free(scheduler, runner)


# --- async reconciliation in update_from_output --------------------------------


@MODES
def test_eos_dead_token_is_discarded(mode: Mode, checkpoint_dir: str) -> None:
    """Async schedules one position past EOS; that output never reaches the client."""
    prompt_len, eos_index = 20, 3
    runner = RecordingRunner(forced={("eos", eos_index): EOS})
    events = arrive(
        (0, req("eos", prompt_len, 10, eos_token_id=EOS)), (0, req("other", 20, 10))
    )
    scheduler, runner, result = run(mode, checkpoint_dir, events, runner=runner)

    eos_step_start = prompt_len + eos_index - 1  # position that samples EOS
    starts = [runner.steps[i].scheduled["eos"][0] for i in steps_of(runner, "eos")]
    assert (max(starts) > eos_step_start) is mode.is_async
    assert max(starts) <= eos_step_start + 1
    expected = expected_tokens("eos", eos_index, runner) + [EOS]
    assert result.tokens["eos"] == expected
    assert result.finish_reasons["eos"] == "stop"
    assert result.tokens["other"] == expected_tokens("other", 10, runner)
    assert_blocks_all_free(scheduler, runner)


@MODES
def test_max_tokens_never_scheduled_past_end(mode: Mode, checkpoint_dir: str) -> None:
    """The last scheduled position samples the last token; no dead token after it."""
    lengths = {"a": (20, 5), "b": (33, 1), "c": (7, 12)}
    events = arrive(*((0, req(r, p, m)) for r, (p, m) in lengths.items()))
    scheduler, runner, result = run(mode, checkpoint_dir, events)
    for req_id, (prompt_len, max_tokens) in lengths.items():
        ends = [
            sum(runner.steps[i].scheduled[req_id]) for i in steps_of(runner, req_id)
        ]
        assert max(ends) == prompt_len + max_tokens - 1
        assert result.tokens[req_id] == expected_tokens(req_id, max_tokens, runner)
        assert result.finish_reasons[req_id] == "length"
    assert_blocks_all_free(scheduler, runner)


def test_abort_while_step_in_flight(checkpoint_dir: str) -> None:
    """An abort between schedule and update: no later output, blocks back once."""
    runner = RecordingRunner()
    aborted: dict[str, int] = {}

    class AbortInFlight(Events):
        def __call__(self, step: int, scheduler: Scheduler) -> None:
            super().__call__(step, scheduler)
            victim = scheduler.requests.get("victim")
            # Abort once it has delivered tokens and its next step is in flight.
            if (
                victim is None
                or aborted
                or victim.num_output_tokens < 2
                or victim.num_output_placeholders == 0
            ):
                return
            block_pool = scheduler.kv_cache_manager.block_pool
            free_before = block_pool.get_num_free_blocks()
            held = len(scheduler.kv_cache_manager.get_block_ids("victim")[0])
            scheduler.finish_requests("victim", RequestStatus.FINISHED_ABORTED)
            aborted.update(
                num_tokens=victim.num_output_tokens,
                step=len(runner.steps),
                held=held,
                freed=block_pool.get_num_free_blocks() - free_before,
            )

    def workload() -> dict[int, list[Request]]:
        return {0: [req(r, 24, 12) for r in ("a", "victim", "b")]}

    _, _, reference = run(ASYNC, checkpoint_dir, Events(workload()))
    events = AbortInFlight(workload())
    scheduler, _, result = run(ASYNC, checkpoint_dir, events, runner=runner)

    assert aborted, "the victim's step was never in flight"
    assert aborted["held"] > 0 and aborted["freed"] == aborted["held"]
    delivered = result.tokens["victim"]
    assert delivered == reference.tokens["victim"][: aborted["num_tokens"]]
    assert "victim" not in result.finish_reasons
    assert all("victim" not in s.scheduled for s in runner.steps[aborted["step"] :])
    for req_id in ("a", "b"):
        assert result.tokens[req_id] == reference.tokens[req_id]
        assert result.finish_reasons[req_id] == "length"
    assert_blocks_all_free(scheduler, runner)


# --- configurations side by side ------------------------------------------------


def test_two_configurations_in_one_process_keep_their_own_limits(
    checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scheduler plans with the limits of its own configuration, and the
    front end refuses only a request that no live engine could run."""
    from vllm.sampling_params import SamplingParams

    from vllm_neuron_sched.platform import NeuronSchedPlatform

    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "100")
    tight = build_scheduler(
        ChunkedPrefillScheduler, checkpoint_dir, async_scheduling=False
    )
    monkeypatch.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "0")
    roomy = build_scheduler(
        ChunkedPrefillScheduler, checkpoint_dir, async_scheduling=False
    )
    assert tight.limits.max_batch_tkv_limit == 100
    assert roomy.limits.max_batch_tkv_limit == 4 * 256  # max_num_seqs x max_model_len
    registry = NeuronSchedPlatform._request_limits
    assert registry[id(tight.vllm_config)] == tight.limits
    assert registry[id(roomy.vllm_config)] == roomy.limits

    # 90 + 20 tokens: too much for the tight engine, fine for the roomy one.
    fits_roomy = {"prompt_token_ids": list(range(10, 100))}
    NeuronSchedPlatform.validate_request(fits_roomy, SamplingParams(max_tokens=20))
    assert tight.limits.check(90, 20) is not None
    too_long = {"prompt_token_ids": [10] * 5000}
    with pytest.raises(ValueError, match="tkv limit"):
        NeuronSchedPlatform.validate_request(too_long, SamplingParams(max_tokens=8))

    # A configuration that is gone no longer counts.
    tight_key = id(tight.vllm_config)
    del tight
    gc.collect()
    assert tight_key not in registry


def test_restricted_view_hides_both_waiting_queues(checkpoint_dir: str) -> None:
    """vLLM drains ``kv_holding_waiting`` before ``waiting``: a step's view
    must hide requests there too, or a decode step could admit one."""
    from vllm_neuron_sched.core.step_view import restricted_view

    scheduler = build_scheduler(
        ChunkedPrefillScheduler, checkpoint_dir, async_scheduling=False
    )
    holding, fresh, planned = (req(f"r{i}", 8, 4) for i in range(3))
    scheduler.kv_holding_waiting.add_request(holding)
    scheduler.kv_holding_waiting.add_request(planned)
    scheduler.waiting.add_request(fresh)

    with restricted_view(scheduler, [], []):
        assert list(scheduler.kv_holding_waiting) == []
        assert list(scheduler.waiting) == []
    with restricted_view(scheduler, [], [planned]):
        assert list(scheduler.kv_holding_waiting) == [planned]
        assert list(scheduler.waiting) == []
    assert list(scheduler.kv_holding_waiting) == [planned, holding]
    assert list(scheduler.waiting) == [fresh]
