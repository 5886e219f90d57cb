"""Engine step tests: drive vLLM's engine one loop iteration at a time.

An ``EngineStepper`` runs ``LLMEngine`` in-process (the engine core and the
worker in this process), so each ``step()`` is exactly one call of
``EngineCore.step()`` (sync) or ``EngineCore.step_with_batch_queue()`` (async,
depth 2), and the scheduler and worker can be read between calls. After every
call it records a ``Row``: what was scheduled, the queues, tkv, KV blocks, what
the client received, and the async counters. A test lists its requests and the
rows it expects; ``assert_rows`` prints the whole table on a mismatch.

EOS is forced at a chosen output index through a public vLLM mechanism, a
logits processor (``ForceTokens``) that reads ``SamplingParams.extra_args``.
Plugin authors can reuse all of this with their own scheduler and worker.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from vllm_neuron_sched.core.step_view import BatchShape
from vllm_neuron_sched.testing.in_process import in_process

FORCE_TOKENS_KEY = "neuron_sched_force_tokens"
FORCE_TOKENS_FQCN = "vllm_neuron_sched.testing.engine_steps:ForceTokens"


class ForceTokens(AdapterLogitsProcessor):
    """Makes output index i be token t for ``extra_args[FORCE_TOKENS_KEY] =
    {i: t}``: the request then stops exactly there when t is EOS or a stop token."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        forced = (params.extra_args or {}).get(FORCE_TOKENS_KEY)
        if not forced:
            return None
        forced = {int(i): int(t) for i, t in forced.items()}

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            token = forced.get(len(output_ids))
            if token is not None:
                logits.fill_(float("-inf"))
                logits[token] = 0.0
            return logits

        return force


@dataclass(frozen=True)
class Req:
    """One request of a step test; step numbers count engine calls from 0."""

    req_id: str
    prompt_len: int
    max_tokens: int
    add_at: int = 0
    # Output index forced to EOS (the request stops there).
    eos_at: int | None = None
    stop: tuple[str, ...] = ()
    abort_at: int | None = None
    # The prompt's token ids; None: made from the request id (prompt_len).
    prompt: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def prompt_token_ids(self) -> list[int]:
        if self.prompt is not None:
            return list(self.prompt)
        seed = sum(map(ord, self.req_id))
        return [(seed * 31 + 7 * i) % 900 + 10 for i in range(self.prompt_len)]


@dataclass
class Row:
    """The state after one engine call."""

    step: int
    # req_id -> tokens scheduled by this call ({} when it scheduled nothing).
    scheduled: dict[str, int]
    # "prefill" | "decode" | "idle": the kind of step this call scheduled.
    kind: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    # The decode batch tkv right after this call's schedule().
    tkv: int
    blocks_used: int
    # Blocks in use right after this call's schedule() (before any update
    # frees a finished request): where a dead token's extra block shows.
    blocks_at_schedule: int
    blocks_reserved: int
    # Requests this call's schedule() preempted (freed their KV, back to waiting).
    preempted: tuple[str, ...]
    # req_id -> tokens the client received in this call.
    delivered: dict[str, int]
    finished: tuple[str, ...]
    async_steps: int
    fallback_steps: int


@dataclass
class Client:
    """What the client saw per request, as LLMEngine's outputs say it."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finish_reason: dict[str, str | None] = field(default_factory=dict)


class EngineStepper:
    def __init__(
        self,
        model: str,
        *,
        async_scheduling: bool,
        eos_token_id: int,
        force_tokens: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """``force_tokens``: with the ``ForceTokens`` logits processor
        (``Req.eos_at``), which vLLM refuses with speculative decoding."""
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(
            model=model,
            async_scheduling=async_scheduling,
            logits_processors=[FORCE_TOKENS_FQCN] if force_tokens else None,
            **{
                "dtype": "float32",
                "max_model_len": 256,
                "max_num_seqs": 4,
                "max_num_batched_tokens": 64,
                "enforce_eager": True,
                "seed": 0,
                **engine_kwargs,
            },
        )
        with in_process():
            self.engine = LLMEngine.from_engine_args(args)
        self.core = self.engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        self.eos_token_id = eos_token_id
        # Per scheduled step: tokens per request, KV blocks in use, preempted
        # ids, and the decode tkv as the scheduler planned it.
        self._scheduled: list[tuple[dict[str, int], int, tuple[str, ...], int]] = []
        schedule = self.scheduler.schedule

        def observed_schedule(*args: Any, **kwargs: Any):
            output = schedule(*args, **kwargs)
            preempted = tuple(
                sorted(self.external_id(r) for r in output.preempted_req_ids or ())
            )
            scheduled = dict(output.num_scheduled_tokens)
            tkv = (
                self.scheduler.decode_tkv()
                if hasattr(self.scheduler, "decode_tkv")
                else 0
            )
            self._scheduled.append((scheduled, self.blocks_used(), preempted, tkv))
            return output

        # Observation only: records each SchedulerOutput, changes nothing.
        self.scheduler.schedule = observed_schedule

    # --- driving ---------------------------------------------------------

    def run(
        self,
        requests: Sequence[Req],
        max_steps: int = 200,
        before_step: Mapping[int, Callable[[], None]] | None = None,
        between_steps: Callable[[int], None] | None = None,
    ) -> tuple[list[Row], Client]:
        """Adds, aborts and steps until every request has finished;
        ``before_step[i]`` runs before engine call i, after its arrivals, and
        ``between_steps(i)`` before every call i."""
        client = Client()
        rows: list[Row] = []
        base = self.counters()
        pending = {r.req_id for r in requests}
        for step in range(max_steps):
            for req in requests:
                if req.add_at == step:
                    self.add(req)
                if req.abort_at == step:
                    self.engine.abort_request([req.req_id], internal=False)
                    pending.discard(req.req_id)
            if before_step and step in before_step:
                before_step[step]()
            if between_steps is not None:
                between_steps(step)
            if not pending and not self.engine.has_unfinished_requests():
                break
            self._scheduled.clear()
            outputs = self.engine.step()
            delivered: dict[str, int] = {}
            finished: list[str] = []
            for out in outputs:
                completion = out.outputs[0]
                delivered[out.request_id] = len(completion.token_ids)
                client.tokens.setdefault(out.request_id, []).extend(
                    completion.token_ids
                )
                client.text[out.request_id] = (
                    client.text.get(out.request_id, "") + completion.text
                )
                if out.finished:
                    client.finish_reason[out.request_id] = completion.finish_reason
                    pending.discard(out.request_id)
                    finished.append(out.request_id)
            rows.append(self._row(step, delivered, finished, base))
        else:
            raise AssertionError(f"requests still running after {max_steps} steps")
        return rows, client

    def add(self, req: Req) -> None:
        extra = {}
        if req.eos_at is not None:
            extra[FORCE_TOKENS_KEY] = {req.eos_at: self.eos_token_id}
        params = SamplingParams(
            temperature=0.0,
            max_tokens=req.max_tokens,
            ignore_eos=req.ignore_eos,
            stop=list(req.stop),
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )
        self.engine.add_request(
            req.req_id, {"prompt_token_ids": req.prompt_token_ids()}, params
        )

    def inject_device_fault(self, num_executions: int = 1) -> None:
        """The ``num_executions``-th device execution enqueued from now fails."""
        self.core.collective_rpc("inject_device_fault", args=(num_executions,))

    def counters(self) -> dict[str, int]:
        """The worker's async counters ({} for a worker without them)."""
        try:
            return self.core.collective_rpc("get_async_scheduling_stats")[0]
        except NotImplementedError:
            return {}

    # --- observing -------------------------------------------------------

    def _row(
        self,
        step: int,
        delivered: dict[str, int],
        finished: list[str],
        base: dict[str, int],
    ) -> Row:
        scheduler = self.scheduler
        scheduled, blocks_at_schedule, preempted, tkv = (
            self._scheduled[-1] if self._scheduled else ({}, self.blocks_used(), (), 0)
        )
        counters = self.counters()
        return Row(
            step=step,
            scheduled={self.external_id(r): n for r, n in scheduled.items()},
            kind=self._kind(scheduled) if self._scheduled else "-",
            running=tuple(self.external_id(r.request_id) for r in scheduler.running),
            waiting=tuple(self.external_id(r.request_id) for r in scheduler.waiting),
            tkv=tkv,
            blocks_used=self.blocks_used(),
            blocks_at_schedule=blocks_at_schedule,
            blocks_reserved=(
                scheduler.reserved_blocks()
                if hasattr(scheduler, "reserved_blocks")
                else 0
            ),
            preempted=preempted,
            delivered=delivered,
            finished=tuple(sorted(finished)),
            async_steps=counters.get("async_steps", 0) - base.get("async_steps", 0),
            fallback_steps=counters.get("sync_fallback_steps", 0)
            - base.get("sync_fallback_steps", 0),
        )

    def blocks_used(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def _kind(self, scheduled: dict[str, int]) -> str:
        """Derived from positions, not from the scheduler's own label."""
        if not scheduled:
            return "idle"
        requests = self.scheduler.requests

        def is_prefill(req_id: str, num_tokens: int) -> bool:
            request = requests.get(req_id)
            if request is None:  # finished since: only its token count is known
                return num_tokens > 1
            start = request.num_computed_tokens - num_tokens
            return num_tokens > 1 or start < request.num_prompt_tokens

        return BatchShape.of(is_prefill(r, n) for r, n in scheduled.items()).value

    @staticmethod
    def external_id(internal_id: str) -> str:
        """LLMEngine appends a random suffix to each request id."""
        return internal_id.rsplit("-", 1)[0]

    def shutdown(self) -> None:
        self.engine.engine_core.shutdown()


def decode_rows(first: int, last: int, tkv: int, **fields: Any) -> list[dict]:
    """Expected rows for a run of decode steps: tkv grows by one per step."""
    return [
        {"step": s, "kind": "decode", "tkv": tkv + s - first, **fields}
        for s in range(first, last + 1)
    ]


def assert_rows(rows: Sequence[Row], expected: Iterable[dict]) -> None:
    """Each expected dict names a step and the fields it checks."""
    by_step = {row.step: row for row in rows}
    mismatches = []
    for want in expected:
        row = by_step.get(want["step"])
        got = asdict(row) if row else {}
        for key, value in want.items():
            if got.get(key) != (tuple(value) if isinstance(value, list) else value):
                mismatches.append((want["step"], key, value, got.get(key)))
    if mismatches:
        lines = [format_table(rows), "mismatches (step, field, expected, actual):"]
        lines += [f"  {m}" for m in mismatches]
        raise AssertionError("\n".join(lines))


def format_table(rows: Sequence[Row]) -> str:
    header = "step kind    tkv used @sch resv async fb  scheduled / delivered / running"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.step:4} {r.kind:7} {r.tkv:4} {r.blocks_used:4} "
            f"{r.blocks_at_schedule:4} "
            f"{r.blocks_reserved:4} {r.async_steps:5} {r.fallback_steps:2}  "
            f"{r.scheduled} / {r.delivered} / {list(r.running)}"
            + (f" finished={list(r.finished)}" if r.finished else "")
            + (f" preempted={list(r.preempted)}" if r.preempted else "")
        )
    return "\n".join(lines)
