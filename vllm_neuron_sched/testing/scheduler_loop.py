"""Drive a scheduler through vLLM's two engine loops with a fake runner.

``run_sync`` is ``EngineCore.step()``: schedule, execute, update.
``run_batch_queue`` is ``EngineCore.step_with_batch_queue()`` at depth 2:
step N+1 is scheduled before step N's output reaches ``update_from_output``.
The fake runner samples a token that depends only on (request, output index),
so both loops must deliver the same tokens whatever the schedule. Plugin authors
can point it at their own scheduler classes.

Speculative decoding (``FakeRunner.num_spec_tokens``): a decode row given
drafts accepts a number of them that depends only on (request, output index),
as a device's verify step would, and returns those plus one; the sync loop
hands the scheduler new drafts (a number of them by the same rule) after each
step, as ``take_draft_token_ids`` does. With async scheduling vLLM's scheduler
plans each step as if every draft of the step before were accepted, so the
runner keeps each request's true position itself.
"""

import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request


def fake_token(request_id: str, index: int, vocab_size: int) -> int:
    """The token a request samples as its ``index``-th output."""
    return zlib.crc32(f"{request_id}/{index}".encode()) % vocab_size


@dataclass
class StepRecord:
    """What one scheduled step held (the emulated device's view)."""

    # req_id -> (position before the step, tokens scheduled)
    scheduled: dict[str, tuple[int, int]]
    is_prefill: dict[str, bool]
    num_running: int
    num_free_blocks: int
    # Decoding requests the step left out although they had a token to run
    # (not one still in flight, as a sync scheduler's in a batch queue).
    ready_decodes: set[str] = field(default_factory=set)


@dataclass
class FakeRunner:
    """Turns a ``SchedulerOutput`` into the ``ModelRunnerOutput`` a runner would."""

    vocab_size: int
    # Forced tokens: (req_id, output index) -> token (EOS, stop tokens).
    forced: dict[tuple[str, int], int] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    # Requests with pooling params: they get a pooler output, not a token.
    pooling: set[str] = field(default_factory=set)
    positions: dict[str, int] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    # Speculative decoding: drafts per verify row (0: none).
    num_spec_tokens: int = 0
    # Requests that sampled in the last step (the sync loop's draft owners).
    last_sampled: list[str] = field(default_factory=list)

    def token(self, req_id: str, index: int) -> int:
        forced = self.forced.get((req_id, index))
        if forced is not None:
            return forced
        return fake_token(req_id, index, self.vocab_size)

    def num_accepted(self, req_id: str, index: int, num_drafts: int) -> int:
        """Drafts a verify row accepts when its first new token is output
        ``index``: random, a pure function of the request and the index."""
        return zlib.crc32(f"{req_id}#{index}".encode()) % (num_drafts + 1)

    def drafts(self) -> DraftTokenIds:
        """New drafts for the requests that just sampled (sync scheduling)."""
        counts = [
            zlib.crc32(f"{r}@{self.positions[r]}".encode()) % (self.num_spec_tokens + 1)
            for r in self.last_sampled
        ]
        return DraftTokenIds(list(self.last_sampled), [[0] * n for n in counts])

    def execute(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        for new in so.scheduled_new_reqs:
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids or ())
            self.positions[new.req_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            # With speculation the scheduler's count may include drafts this
            # runner rejected (async): it keeps its own but after preemption.
            if not self.num_spec_tokens or req_id in cached.resumed_req_ids:
                self.positions[req_id] = computed
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        pooled: list[torch.Tensor | None] = []
        record = StepRecord({}, {}, len(scheduler.running), 0)
        self.last_sampled = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            start = self.positions[req_id]
            prompt_len = self.prompt_lens[req_id]
            record.scheduled[req_id] = (start, num_tokens)
            record.is_prefill[req_id] = start < prompt_len or req_id in (
                cached.resumed_req_ids
            )
            num_drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            end = start + num_tokens - num_drafts
            accepted = 0
            if num_drafts:
                accepted = self.num_accepted(req_id, end - prompt_len, num_drafts)
            self.positions[req_id] = end + accepted
            req_ids.append(req_id)
            # The step samples (or pools) once its input reaches the prompt's end.
            is_done = end >= prompt_len
            if req_id in self.pooling:
                sampled.append([])
                pooled.append(torch.zeros(4) if is_done else None)
            else:
                first = end - prompt_len
                tokens = [self.token(req_id, first + i) for i in range(1 + accepted)]
                sampled.append(tokens if is_done else [])
                pooled.append(None)
                if is_done:
                    self.last_sampled.append(req_id)
        record.ready_decodes = {
            r.request_id
            for r in scheduler.running
            if r.request_id not in so.num_scheduled_tokens
            and not r.is_prefill_chunk
            and r.num_tokens_with_spec + r.num_output_placeholders
            > r.num_computed_tokens
            and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
        }
        block_pool = scheduler.kv_cache_manager.block_pool
        record.num_free_blocks = block_pool.get_num_free_blocks()
        self.steps.append(record)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            pooler_output=pooled if self.pooling.intersection(req_ids) else None,
        )


@dataclass
class LoopResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    num_steps: int = 0

    def collect(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for eco in outputs.values():
            for out in eco.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    assert out.request_id not in self.finish_reasons, (
                        f"{out.request_id} finished twice"
                    )
                    self.finish_reasons[out.request_id] = str(out.finish_reason)


# Called before each schedule() with the step index: add or abort requests.
Events = Callable[[int, Scheduler], None]


def run_sync(
    scheduler: Scheduler, runner: FakeRunner, events: Events, max_steps: int = 10_000
) -> LoopResult:
    result = LoopResult()
    for step in range(max_steps):
        events(step, scheduler)
        if not scheduler.has_requests():
            if step > runner_last_event(events):
                break
            continue
        so = scheduler.schedule()
        result.collect(scheduler.update_from_output(so, runner.execute(so, scheduler)))
        result.num_steps += 1
        if runner.num_spec_tokens and so.total_num_scheduled_tokens:
            scheduler.update_draft_token_ids(runner.drafts())
    return result


def run_batch_queue(
    scheduler: Scheduler,
    runner: FakeRunner,
    events: Events,
    depth: int = 2,
    max_steps: int = 10_000,
) -> LoopResult:
    """Schedule ahead while the queue has room, as the engine core does."""
    result = LoopResult()
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for step in range(max_steps):
        events(step, scheduler)
        if scheduler.has_requests():
            so = scheduler.schedule()
            queue.appendleft((so, runner.execute(so, scheduler)))
            executed = so.total_num_scheduled_tokens > 0
            if len(queue) < depth and (executed or scheduler.has_requests()):
                continue
        elif not queue:
            if step > runner_last_event(events):
                break
            continue
        so, model_output = queue.pop()
        result.collect(scheduler.update_from_output(so, model_output))
        result.num_steps += 1
    return result


def interleaving_violations(steps: Sequence[Mapping[str, bool]]) -> list[int]:
    """Steps that are a prefill right after a prefill while a decode waited.

    ``steps``: per step, ``req_id -> is_prefill`` of what it held (empty: an
    idle step, skipped: it gives decodes no turn). A request that decodes
    before the first prefill and after the second was in the decode batch,
    able to decode, during both.
    """
    decode_steps: dict[str, list[int]] = {}
    busy: list[tuple[int, bool]] = []
    for i, step in enumerate(steps):
        if step:
            busy.append((i, all(step.values())))
        for req_id, is_prefill in step.items():
            if not is_prefill:
                decode_steps.setdefault(req_id, []).append(i)
    return [
        second
        for (first, is_prefill), (second, next_is_prefill) in zip(busy, busy[1:])
        if is_prefill
        and next_is_prefill
        and any(s[0] < first and s[-1] > second for s in decode_steps.values())
    ]


def runner_last_event(events: Events) -> int:
    """Steps after which no event adds work (events expose ``last_step``)."""
    return getattr(events, "last_step", -1)


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    *,
    eos_token_id: int | None = None,
    stop_token_ids: list[int] | None = None,
    vocab_size: int = 1024,
    prompt: list[int] | None = None,
    block_size: int | None = None,
) -> Request:
    """``block_size``: hash the request's blocks, for a prefix-caching
    scheduler of that block size (the engine core does this for real ones)."""
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, stop_token_ids=stop_token_ids or [], temperature=0.0
    )
    if eos_token_id is not None:
        params.update_from_generation_config({}, eos_token_id)
    if prompt is None:
        prompt = [fake_token(request_id, -1 - i, vocab_size) for i in range(prompt_len)]
    hasher = None
    if block_size is not None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(block_size, sha256)
    return Request(request_id, prompt, params, None, block_hasher=hasher)


def build_scheduler(
    scheduler_cls: type[Scheduler],
    model_dir: str,
    *,
    async_scheduling: bool,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    runner: str = "auto",
    enable_prefix_caching: bool = False,
    num_spec_tokens: int = 0,
    draft_model: bool = False,
    sliding_window: int | None = None,
) -> Scheduler:
    """A scheduler over a fake KV cache of ``num_blocks`` blocks, no engine.
    ``num_spec_tokens``: speculative decoding with that many drafts, n-gram,
    or with ``draft_model`` a draft (the model itself), whose KV lookahead
    vLLM's scheduler allocates. ``sliding_window``: a second KV cache group,
    of sliding-window layers (a hybrid model, as Gemma's), sharing the
    blocks."""
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=model_dir,
        dtype="float32",
        max_model_len=max_model_len,
        seed=0,
        runner=runner,
        skip_tokenizer_init=True,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        speculative_config=None
        if not num_spec_tokens
        else SpeculativeConfig(
            method="draft_model",
            model=model_dir,
            num_speculative_tokens=num_spec_tokens,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
        if draft_model
        else SpeculativeConfig(
            method="ngram_gpu" if async_scheduling else "ngram",
            num_speculative_tokens=num_spec_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=1,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    layer = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=block_size, **layer))
    ]
    if sliding_window is not None:
        window = SlidingWindowSpec(
            block_size=block_size, sliding_window=sliding_window, **layer
        )
        groups.append(KVCacheGroupSpec(["layer.1"], window))
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )
