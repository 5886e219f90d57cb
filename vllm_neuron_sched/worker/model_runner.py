"""A Neuron-style model runner: static shapes, a device queue, the async flow.

One step, on the worker's main thread::

    execute_model:  begin step (retire outputs, guard) -> update states
                    -> prepare inputs (choose input ids) -> enqueue forward
    sample_tokens:  enqueue sampling -> placeholders -> output (async or not)

The forward and the sampler run on the device (``runtime.make_device``), in
enqueue order; the host never waits for them in steady-state decode. Host
request state (``requests``, ``input_batch``) has one owner, this thread:
sampled tokens enter it as placeholders at enqueue and are filled in here from
materialized outputs, never by the async output thread.
"""

import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.interfaces_base import is_text_generation_model
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    LogprobsTensors,
    ModelRunnerOutput,
)
from vllm.v1.sample.sampler import Sampler

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime import DeviceFuture, Materializer, make_device
from vllm_neuron_sched.worker.async_flow import (
    HOST,
    AsyncFlow,
    InputChoice,
    PendingStep,
)
from vllm_neuron_sched.worker.buckets import Buckets
from vllm_neuron_sched.worker.inputs import (
    PLACEHOLDER_TOKEN_ID,
    StepInputs,
    build_attention_metadata,
    build_step_inputs,
)
from vllm_neuron_sched.worker.kv_cache import KVCacheMixin
from vllm_neuron_sched.worker.requests import RequestStatesMixin
from vllm_neuron_sched.worker.sampling import (
    AsyncStepOutput,
    make_output_materializer,
    prompt_logprobs_on_device,
    sample_on_device,
    snapshot_sampling_metadata,
)
from vllm_neuron_sched.worker.timeline import StepTimeline

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = init_logger(__name__)

# A device that has not drained by then is hung; the process exits regardless.
_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class ForwardState:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: "SchedulerOutput"
    inputs: StepInputs
    logits: DeviceFuture  # [num_reqs, vocab]
    prompt_logprobs: dict[str, LogprobsTensors]  # final-chunk rows only


@dataclass
class InFlightStep:
    """A sampling step whose tokens are not all in host state yet."""

    req_ids: tuple[str, ...]
    next_input_ids: DeviceFuture  # [num_rows_padded] int32
    num_rows_padded: int
    output: Materializer[ModelRunnerOutput]
    # req_id -> index of its placeholder in output_token_ids.
    placeholder_index: dict[str, int] = field(default_factory=dict)


class NeuronSchedModelRunner(KVCacheMixin, RequestStatesMixin):
    def __init__(self, vllm_config: "VllmConfig", device: torch.device) -> None:
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("vllm_neuron_sched does not support pipeline parallel")
        if vllm_config.speculative_config is not None:
            raise ValueError("vllm_neuron_sched does not support speculative decoding")
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.compilation_config = vllm_config.compilation_config
        scheduler_config = vllm_config.scheduler_config
        self.device = device
        self.is_async = bool(scheduler_config.async_scheduling)
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = self.model_config.max_model_len
        self.vocab_size = self.model_config.get_vocab_size()
        self.buckets = Buckets.from_limits(
            envs.VLLM_NEURON_SCHED_DECODE_BUCKETS,
            self.max_num_reqs,
            self.max_num_tokens,
        )
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.tp_rank = get_tp_group().rank_in_group
        self.accelerator = make_device(name=f"tp{self.tp_rank}")
        if self.accelerator.name != "inline":
            _unbind_host_thread()
        self.model: Any = None
        self.flow = AsyncFlow(self._materialize_pending)
        self.dead_tokens = 0
        self._in_flight: deque[InFlightStep] = deque()
        # TP consistency (get_rank_state): most steps ever in flight at once,
        # and a digest of every finished request's final token history.
        self._max_in_flight = 0
        self._finished_digest = hashlib.sha256()
        self._forward: ForwardState | None = None
        self._direct_output: ModelRunnerOutput | None = None
        self._stats_logged_at = time.monotonic()
        self._init_request_states()
        self._init_kv_cache_state()
        # Benchmarks only (VLLM_NEURON_SCHED_TIMELINE): None = not recorded.
        self.timeline = StepTimeline.from_env()
        if self.timeline is not None:
            self.timeline.instrument(self)

    # ---- engine-facing API -------------------------------------------------

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm_neuron_sched cannot load dummy weights")
        self.model = get_model(vllm_config=self.vllm_config)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",) if is_text_generation_model(self.model) else ()

    def update_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def take_draft_token_ids(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def get_async_scheduling_stats(self) -> dict[str, int]:
        return {**self.flow.stats(), "dead_tokens": self.dead_tokens}

    def get_rank_state(self) -> dict[str, Any]:
        """In-flight steps and a digest of the host token histories, after
        waiting for those steps: equal on every TP rank when no rank drifts."""
        num_in_flight = len(self._in_flight)
        self._retire_in_flight(keep_latest=False)
        digest = hashlib.sha256()
        for req_id in sorted(self.requests):
            state = self.requests[req_id]
            digest.update(f"{req_id}:{state.output_token_ids};".encode())
            row = self.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                num_tokens = int(self.input_batch.num_tokens_no_spec[row])
                tokens = self.input_batch.token_ids_cpu[row, :num_tokens].tolist()
                digest.update(f"{tokens};".encode())
        return {
            "tp_rank": self.tp_rank,
            "in_flight_steps": num_in_flight,
            "max_in_flight_steps": self._max_in_flight,
            "finished_digest": self._finished_digest.hexdigest(),
            "num_requests": len(self.requests),
            "history_digest": digest.hexdigest(),
        }

    def shutdown(self) -> None:
        """Drains the device before the worker releases what it uses (the
        model, the KV cache, the process): at most two steps are queued."""
        self.accelerator.shutdown(wait=True, timeout_s=_SHUTDOWN_TIMEOUT_S)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: "SchedulerOutput", intermediate_tensors: Any = None
    ) -> ModelRunnerOutput | None:
        """Enqueues the step's forward. None: sample_tokens() follows; else
        the step sampled nothing and this is its output."""
        self._begin_step(scheduler_output)
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs, choice = self._prepare_inputs(scheduler_output)
        self._enqueue_forward(scheduler_output, inputs, choice)
        return None if inputs.has_samples else self._finish_without_sampling(inputs)

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: "GrammarOutput | None"
    ) -> ModelRunnerOutput | AsyncStepOutput:
        """Enqueues on-device sampling. Async: the output is a future the
        engine reads later; the sampled tokens feed the next step on device."""
        if self._direct_output is not None:
            output, self._direct_output = self._direct_output, None
            return output
        forward, self._forward = self._forward, None
        if forward is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step = self._enqueue_sampling(forward, grammar_output)
        if not self.is_async:
            self._retire_in_flight(keep_latest=False)
            return step.output.get()
        self.flow.reinstate(
            PendingStep(
                step.req_ids, step.next_input_ids, step.num_rows_padded, torch.int32
            )
        )
        return AsyncStepOutput(step.output)

    # ---- the step pipeline --------------------------------------------------

    def _begin_step(self, scheduler_output: "SchedulerOutput") -> None:
        """Brings host state up to date with finished outputs (bounded: only
        the latest sampling step may stay in flight), then the flow's guard."""
        self._direct_output = None
        self._retire_in_flight(keep_latest=True)
        if not self.is_async:
            return
        if self.flow.pending is not None and self._in_flight:
            sampled = self._in_flight[-1].placeholder_index
            self.dead_tokens += len(scheduler_output.finished_req_ids & sampled.keys())
        self.flow.guard(scheduler_output.num_scheduled_tokens)
        if finished := sorted(scheduler_output.finished_req_ids & self.requests.keys()):
            self._retire_in_flight(keep_latest=False)  # no-op after the guard
            for req_id in finished:
                history = self.requests[req_id].output_token_ids
                self._finished_digest.update(f"{req_id}:{history};".encode())
        self._maybe_log_stats()

    def _prepare_inputs(
        self, scheduler_output: "SchedulerOutput"
    ) -> tuple[StepInputs, InputChoice]:
        inputs = self._build_inputs(scheduler_output)
        choice = HOST
        if self.is_async:
            choice = self.flow.choose_input_ids(
                inputs.req_ids,
                inputs.kind,
                inputs.num_tokens_padded,
                inputs.input_ids.dtype,
                inputs.has_placeholders,
            )
            if choice.must_rebuild:
                inputs = self._build_inputs(scheduler_output)
        if not choice.uses_future and inputs.has_placeholders:
            # Defensive: never run host inputs that hold a device token.
            self._retire_in_flight(keep_latest=False)
            inputs = self._build_inputs(scheduler_output)
        return inputs, choice

    def _build_inputs(self, scheduler_output: "SchedulerOutput") -> StepInputs:
        return build_step_inputs(
            self.input_batch,
            scheduler_output.num_scheduled_tokens,
            self.buckets,
            self.attn_groups,
        )

    def _enqueue_forward(
        self,
        scheduler_output: "SchedulerOutput",
        inputs: StepInputs,
        choice: InputChoice,
    ) -> None:
        jobs, prompt_logprobs = self._prompt_logprobs_jobs(inputs)
        row_map = None if choice.row_map is None else torch.tensor(choice.row_map)
        logits = self.accelerator.enqueue(
            self._forward_on_device,
            choice.tokens if choice.uses_future else inputs.input_ids,
            row_map,
            inputs.positions,
            inputs.attn_inputs,
            inputs.slot_mapping,
            inputs.num_tokens_padded,
            inputs.logits_indices if inputs.has_samples else None,
            jobs,
        )
        self._forward = ForwardState(scheduler_output, inputs, logits, prompt_logprobs)

    def _forward_on_device(
        self,
        input_ids: torch.Tensor,
        row_map: torch.Tensor | None,
        positions: torch.Tensor,
        attn_inputs: list[tuple[Any, Any]],
        slot_mapping: dict[str, torch.Tensor],
        num_tokens_padded: int,
        logits_indices: torch.Tensor | None,
        prompt_logprobs_jobs: list[tuple],
    ) -> torch.Tensor | None:
        """Runs on the device thread: the model at its padded shape."""
        with torch.inference_mode():
            if row_map is not None:
                remapped = torch.zeros_like(input_ids)
                remapped[: row_map.shape[0]] = input_ids[row_map]
                input_ids = remapped
            with set_forward_context(
                build_attention_metadata(attn_inputs),
                self.vllm_config,
                num_tokens=num_tokens_padded,
                slot_mapping=slot_mapping,
            ):
                hidden_states = self.model(input_ids=input_ids, positions=positions)
            for job in prompt_logprobs_jobs:
                prompt_logprobs_on_device(
                    self.model,
                    self.sampler,
                    self.model_config.logprobs_mode,
                    hidden_states,
                    *job,
                )
            if logits_indices is None:
                return None
            return self.model.compute_logits(hidden_states[logits_indices])

    def _enqueue_sampling(
        self, forward: ForwardState, grammar_output: "GrammarOutput | None"
    ) -> InFlightStep:
        inputs = forward.inputs
        metadata = snapshot_sampling_metadata(
            self.input_batch.sampling_metadata,
            self.input_batch.req_output_token_ids,
        )
        prev_tokens, prev_row = self._history_repair(metadata, inputs.req_ids)
        grammar = None
        if grammar_output is not None:
            grammar = (forward.scheduler_output, grammar_output, list(inputs.req_ids))
        num_rows_padded = self.buckets.pad_decode(inputs.num_reqs)
        result = self.accelerator.enqueue(
            sample_on_device,
            self.sampler,
            forward.logits,
            metadata,
            num_rows_padded,
            [i for i, s in enumerate(inputs.is_sampled) if not s],
            prev_tokens,
            prev_row,
            grammar,
        )
        step = InFlightStep(
            req_ids=tuple(inputs.req_ids),
            next_input_ids=result.select("next_input_ids"),
            num_rows_padded=num_rows_padded,
            output=make_output_materializer(
                result, inputs.req_ids, inputs.is_sampled, forward.prompt_logprobs
            ),
        )
        self._add_placeholders(step, inputs)
        self._in_flight.append(step)
        self._max_in_flight = max(self._max_in_flight, len(self._in_flight))
        return step

    def _history_repair(
        self, metadata: Any, req_ids: list[str]
    ) -> tuple[DeviceFuture | None, list[int]]:
        """Penalties read token histories; a history ending in a placeholder
        gets the token from the previous step's future, on device."""
        histories = metadata.output_token_ids
        if not any(h and h[-1] == PLACEHOLDER_TOKEN_ID for h in histories):
            return None, []
        last = self._in_flight[-1]
        row_of = {req_id: row for row, req_id in enumerate(last.req_ids)}
        return last.next_input_ids, [row_of.get(r, -1) for r in req_ids]

    def _finish_without_sampling(self, inputs: StepInputs) -> ModelRunnerOutput:
        """A step of prompt chunks that are not the last: no token, no wait."""
        self._forward = None
        self.flow.reinstate(None)
        self._direct_output = ModelRunnerOutput(
            req_ids=list(inputs.req_ids),
            req_id_to_index={req_id: i for i, req_id in enumerate(inputs.req_ids)},
            sampled_token_ids=[[] for _ in inputs.req_ids],
        )
        return self._direct_output

    # ---- host state from device results (main thread only) ------------------

    def _materialize_pending(self, pending: PendingStep) -> None:
        """The flow breaks: wait for every in-flight output and apply it."""
        self._retire_in_flight(keep_latest=False)

    def _retire_in_flight(self, keep_latest: bool) -> None:
        while len(self._in_flight) > (1 if keep_latest else 0):
            self._apply_sampled_tokens(self._in_flight.popleft())
        if self._in_flight and self._in_flight[-1].output.is_materialized():
            self._apply_sampled_tokens(self._in_flight[-1])

    def _add_placeholders(self, step: InFlightStep, inputs: StepInputs) -> None:
        batch = self.input_batch
        for row, req_id in enumerate(inputs.req_ids):
            if not inputs.is_sampled[row]:
                continue
            state = self.requests[req_id]
            step.placeholder_index[req_id] = len(state.output_token_ids)
            state.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
            position = int(batch.num_tokens_no_spec[row])
            if position < batch.token_ids_cpu.shape[1]:
                batch.token_ids_cpu[row, position] = PLACEHOLDER_TOKEN_ID
            batch.num_tokens_no_spec[row] = position + 1

    def _apply_sampled_tokens(self, step: InFlightStep) -> None:
        """Fills placeholders with real tokens. Idempotent: a placeholder is
        filled once; finished or resumed requests are skipped."""
        output = step.output.get()
        batch = self.input_batch
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            index = step.placeholder_index.get(req_id)
            state = self.requests.get(req_id)
            if index is None or not tokens or state is None:
                continue
            history = state.output_token_ids
            if index >= len(history) or history[index] != PLACEHOLDER_TOKEN_ID:
                continue
            history[index] = tokens[0]
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                batch.token_ids_cpu[row, state.num_prompt_tokens + index] = tokens[0]

    def _maybe_log_stats(self) -> None:
        interval = envs.VLLM_NEURON_SCHED_STATS_INTERVAL_S
        now = time.monotonic()
        if interval <= 0 or now - self._stats_logged_at < interval or self.tp_rank:
            return
        self._stats_logged_at = now
        stats = self.get_async_scheduling_stats()
        logger.info(
            "Async scheduling: %d async steps, %d sync fallback steps, "
            "%d prefill steps, %d dead tokens",
            stats["async_steps"],
            stats["sync_fallback_steps"],
            stats["prefill_steps"],
            stats["dead_tokens"],
        )


def _unbind_host_thread() -> None:
    """On CPU the "device" is the cores the CPU worker bound this thread to:
    the device thread, already started, keeps them. This (host) thread, and
    the executor's output thread started after it, may use any core, so host
    work overlaps the device instead of time-slicing with it on one core."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError as exc:
            logger.debug("Host thread keeps its CPU binding: %s", exc)
