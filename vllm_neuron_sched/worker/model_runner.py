"""A Neuron-style model runner: static shapes, a device queue, the async flow.

One step, on the worker's main thread::

    execute_model:  flow.begin_step (the retired steps' tokens and the
                    scheduler's decisions into host state) -> zero new KV
                    blocks -> step_kinds.start (the step's rows pick its
                    kind, which builds it and enqueues its forward)
    sample_tokens:  step.enqueue_sampling -> placeholders in host state ->
                    flow.end_step (in flight, counted; the output now in
                    sync mode, a future in async mode)

Each call enters each module once (``testing/step_hops.py``).

Every step that runs anything returns its output from ``sample_tokens``,
also one whose rows all run prompt chunks that are not their last (it samples
nothing, and its output says whether its forward failed): no device failure
goes unread.

The parts, each with one owner's state: ``host_state`` (requests, the input
batch, token slots, placeholders), ``async_flow`` (the steps in flight and
their counters), ``token_table`` (the device token table and the decode-id
gather), ``steps`` (the step kinds: each builds its inputs, from
``inputs`` and ``layout``, and owns its device program; ``spec/`` holds the
kinds of an engine that speculates and its proposers), ``results`` (the typed
device results and the output back), ``kv_cache``. The forward and the
sampler run on the device (``runtime``), in enqueue order.

Ownership: an execution enqueued on the device owns every buffer it reads
until its future resolves. The host builds each step into fresh tensors and
never writes, resizes or frees one that an enqueued execution may read; state
that lives across steps on the device (the KV cache, the token table, the
attention builders and vLLM's CPU scratchpad behind them) is touched by device
executions only. Host state has one owner, this thread: sampled tokens enter
it as placeholders at enqueue and are filled in here when their step retires,
never by the async output thread.
"""

import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm import envs as vllm_envs
from vllm.config import CompilationMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.interfaces_base import is_text_generation_model
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    ModelRunnerOutput,
)
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler

from vllm_neuron_sched import envs
from vllm_neuron_sched.core.errors import finishes_failed_requests
from vllm_neuron_sched.core.prefill_shapes import engine_prefill_shapes
from vllm_neuron_sched.runtime import Materializer
from vllm_neuron_sched.worker.async_flow import AsyncFlow, AsyncStepOutput, InFlightStep
from vllm_neuron_sched.worker.buckets import Buckets
from vllm_neuron_sched.worker.compiled import (
    CompiledProgram,
    compile_options,
    compile_per_shape,
    compile_programs,
    forward_graphs,
    forward_sizes,
    warm_up,
)
from vllm_neuron_sched.worker.host_state import (
    HostRequestState,
    StepUpdate,
)
from vllm_neuron_sched.worker.kv_cache import KVCache
from vllm_neuron_sched.worker.lm_head import Head
from vllm_neuron_sched.worker.lora import Adapters
from vllm_neuron_sched.worker.observers import RankDigest, StatsLog
from vllm_neuron_sched.worker.pipeline import (
    ONE_STAGE,
    PipelineStage,
    Stage,
    empty_hidden,
)
from vllm_neuron_sched.worker.programs import Dimensions, StageShapes
from vllm_neuron_sched.worker.results import DraftedOutput
from vllm_neuron_sched.worker.sampling import noise_dtype
from vllm_neuron_sched.worker.sampling_state import SamplingState
from vllm_neuron_sched.worker.spec.config import DRAFT_MODEL, Speculation
from vllm_neuron_sched.worker.spec.draft_model import DraftModel
from vllm_neuron_sched.worker.spec.proposer import NgramProposer, Proposer
from vllm_neuron_sched.worker.spec.steps import SPECULATIVE_STEPS
from vllm_neuron_sched.worker.steps import PLAIN_STEPS, Step, StepContext
from vllm_neuron_sched.worker.timeline import StepTimeline
from vllm_neuron_sched.worker.token_table import DeviceTokens, history_width

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_neuron_sched.runtime import Device, DeviceFuture

logger = init_logger(__name__)

# A device that has not drained by then is hung; the process exits regardless.
_SHUTDOWN_TIMEOUT_S = 30.0
_NO_LORA = "LoRA is not enabled. Use --enable-lora to enable LoRA."  # vLLM's


def _stop_rank_if_failed(result: "DeviceFuture[Any]") -> None:
    """A rank whose outputs the engine never reads (not the output rank)
    would keep a failed step to itself, and its peers would wait for it in
    a transfer or a collective: it exits, the cause in its log, and the
    executor, which watches its workers, stops the engine."""
    error = result.exception()
    if error is None:
        return
    logger.error("A device execution of this rank failed; exiting: %s", error)
    logging.shutdown()
    os._exit(1)


@dataclass(frozen=True)
class _PendingStep:
    """What execute_model leaves for sample_tokens."""

    step: Step
    scheduler_output: "SchedulerOutput"
    update: StepUpdate


class NeuronSchedModelRunner:
    """``tp_group``: vLLM's TP group of this worker (its rank and world size
    are read); ``pp_group``: its pipeline group, with more than one stage.
    ``device``: the runtime device every execution is enqueued on.
    ``torch_device``: where tensors live (the CPU here)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        tp_group: "GroupCoordinator",
        device: "Device",
        torch_device: torch.device | None = None,
        pp_group: "GroupCoordinator | None" = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        scheduler_config = vllm_config.scheduler_config
        self.is_async = bool(scheduler_config.async_scheduling)
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.tp_rank = tp_group.rank_in_group
        self.device = device
        stage: Stage = (
            PipelineStage(pp_group)
            if pp_group is not None and pp_group.world_size > 1
            else ONE_STAGE
        )
        self.ctx = self._step_context(
            tp_group, torch_device or torch.device("cpu"), stage
        )
        self.kv_cache = self.ctx.kv_cache
        # The plain kinds run on any pipeline stage (``ctx.stage``); the
        # start-up check refuses speculation with pipeline stages.
        self.step_kinds = (
            PLAIN_STEPS if self.ctx.speculation is None else SPECULATIVE_STEPS
        )
        # The engine reads the outputs of TP rank 0 of the last stage.
        self.is_output_rank = self.tp_rank == 0 and stage.is_last
        # The newest sampling step's output, whose drafts the scheduler may
        # ask for (``take_draft_token_ids``).
        self._drafted: Materializer[ModelRunnerOutput] | None = None
        self.host = HostRequestState(
            self.model_config.get_vocab_size(),
            self.max_num_reqs,
            self.max_num_tokens,
        )
        self.flow = AsyncFlow(
            device,
            self.host,
            is_output_rank=self.is_output_rank,
            queue_depth=self._queue_depth(),
        )
        self._subscribe_observers()
        # What execute_model leaves for sample_tokens.
        self._pending: _PendingStep | None = None

    def _queue_depth(self) -> int:
        """The engine's batch queue with async scheduling (vLLM's: 2, or the
        pipeline's stages). In sync mode each step is read before the next,
        whatever the queue (with pipeline stages, as deep as the pipeline)."""
        return self.vllm_config.max_concurrent_batches if self.is_async else 1

    def _step_context(
        self,
        tp_group: "GroupCoordinator",
        torch_device: torch.device,
        stage: Stage,
    ) -> StepContext:
        vllm_config = self.vllm_config
        buckets = Buckets.from_limits(
            envs.VLLM_NEURON_SCHED_DECODE_BUCKETS,
            self.max_num_reqs,
            self.max_num_tokens,
            engine_prefill_shapes(vllm_config),
        )
        spec = Speculation.from_config(vllm_config)
        self.draft: DraftModel | None = None
        proposer: Proposer | None = None
        if spec is not None and spec.method == DRAFT_MODEL:
            # It also runs its forward after every prefill forward.
            proposer = self.draft = DraftModel(vllm_config, spec, buckets)
        elif spec is not None:
            proposer = NgramProposer(spec)
        return StepContext(
            device=self.device,
            vllm_config=vllm_config,
            sampler=Sampler(
                logprobs_mode=self.model_config.logprobs_mode,
                use_fp64_gumbel=self.model_config.use_fp64_gumbel,
            ),
            token_table=DeviceTokens(
                self.max_num_reqs,
                history_width(
                    self.model_config.max_model_len,
                    0 if spec is None else spec.num_tokens,
                ),
                num_drafts=0 if spec is None else spec.num_tokens,
            ),
            # vLLM's processors (built-in and the user's: refused with
            # speculation, as vLLM does), on the device side.
            sampling=SamplingState(
                build_logitsprocs(
                    vllm_config,
                    torch.device("cpu"),
                    False,
                    False,
                    tuple(self.model_config.logits_processors or ()),
                )
            ),
            buckets=buckets,
            kv_cache=KVCache(vllm_config, torch_device, self.device),
            # Our schedulers finish a failed step's requests and serve the
            # others. Under any other scheduler, and with TP ranks or
            # pipeline stages (a failure in a collective or a transfer means
            # a peer is gone, and ranks cannot know they failed alike), a
            # device failure stops the engine.
            fails_requests_alone=tp_group.world_size == 1
            and not stage.is_pipeline
            and finishes_failed_requests(
                getattr(vllm_config.scheduler_config, "scheduler_cls", None)
            ),
            speculation=spec,
            proposer=proposer,
            stage=stage,
        )

    def _subscribe_observers(self) -> None:
        # TP consistency (get_rank_state): final token histories, digested.
        self.digest = RankDigest()
        self.flow.subscribe(self.digest)
        interval_s = envs.VLLM_NEURON_SCHED_STATS_INTERVAL_S
        if self.is_output_rank and interval_s > 0:
            self.flow.subscribe(StatsLog(self.flow, time.monotonic, interval_s))
        # Benchmarks only (VLLM_NEURON_SCHED_TIMELINE): None = not recorded.
        self.timeline = StepTimeline.from_env()
        if self.timeline is not None:
            self.flow.subscribe(self.timeline)

    # ---- engine-facing API -------------------------------------------------

    @property
    def model(self) -> Any:
        return self.ctx.model

    @model.setter
    def model(self, model: Any) -> None:
        self.ctx.model = model

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm_neuron_sched cannot load dummy weights")
        self.model = get_model(vllm_config=self.vllm_config)
        if self.vllm_config.lora_config is not None:
            self.model, self.ctx.lora = Adapters.wrap(
                self.model, self.vllm_config, self.device
            )
        if self.draft is not None:
            self.draft.load()
        if self.device.compiles_per_shape:
            for model in self._models():
                compile_per_shape(model, self.vllm_config)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",) if is_text_generation_model(self.model) else ()

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The CPU worker asks whether a KV cache exists."""
        return self.kv_cache.caches

    def get_kv_cache_spec(self) -> "dict[str, KVCacheSpec]":
        return self.kv_cache.spec()

    def initialize_kv_cache(
        self, kv_cache_config: "KVCacheConfig", **kwargs: Any
    ) -> None:
        """Allocates the KV cache, then the input batch (its block tables
        need the block sizes). ``kwargs``: vLLM's, unused."""
        block_sizes = self.kv_cache.allocate(kv_cache_config)
        if self.draft is not None:
            self.draft.bind(self.kv_cache.draft_groups)
        self.host.allocate_batch(
            block_sizes,
            self.max_model_len,
            # The user's processors may read the histories, as vLLM tells
            # its sampler (``sampling_state.py``: the device's).
            logitsprocs_need_output_token_ids=bool(self.model_config.logits_processors),
        )

    def warming_up_model(self) -> None:
        """Compiles the model before serving (the CPU worker calls this while
        sizing memory): for its general shape, or on the compiled device for
        every declared shape."""
        if self.device.compiles_per_shape:
            spec = self.ctx.speculation

            def on_device(fn: Any, *args: Any) -> Any:
                return self.device.enqueue(fn, *args).result()

            sizes = forward_sizes(
                self.ctx.buckets, 1 if spec is None else 1 + spec.num_tokens
            )
            warm_up(
                self._models(),
                sizes,
                self._dummy_forward,
                on_device,
                f"{self.device.label}: forward",
            )
            self._compile_programs(spec, sizes, on_device)
            return
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
        logger.info("Warming up model for compilation...")
        self.device.enqueue(self._dummy_forward, self.max_num_tokens).result()
        logger.info("Warming up done.")

    def _compile_programs(
        self, spec: Speculation | None, sizes: tuple[int, ...], on_device: Any
    ) -> None:
        """The programs around the forward (sampling, penalties and bad
        words; with speculation the verify step's, its queries and the
        n-gram proposal) compiled per decode bucket, the token table's (per
        decode bucket, and the forward's ids per token count: ``sizes``),
        and a pipeline stage's transfers, in place of the eager ones."""
        is_ngram = isinstance(self.ctx.proposer, NgramProposer)
        dims = Dimensions(
            rows=self.ctx.buckets.decode,
            vocab=self.model_config.get_vocab_size(),
            history_len=self.ctx.token_table.history_len,
            slots=self.ctx.token_table.num_slots,
            tokens=sizes,
            noise_dtype=noise_dtype(self.ctx.sampler),
            logprobs_mode=self.ctx.sampler.logprobs_mode,
            # vLLM's limits per request, as its GPU runner lays them out.
            bad_words=(
                vllm_envs.VLLM_MAX_NUM_BAD_WORDS,
                vllm_envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS,
            ),
        )
        if spec is not None:  # no verify step without: no shape declared
            dims = replace(
                dims,
                num_drafts=spec.num_tokens,
                # No n-gram proposer: its program has no declared shape.
                min_n=spec.min_n if is_ngram else 0,
                max_n=spec.max_n if is_ngram else 0,
                max_model_len=spec.max_model_len,
                # Before the KV cache exists: the cache config's, every
                # group's (attention layers only, ``kv_cache.py``).
                block_sizes=(self.vllm_config.cache_config.block_size,),
            )
        if isinstance(self.ctx.stage, PipelineStage):
            dims = replace(dims, stage=StageShapes.of(self.ctx.stage, self.model))
        if self.ctx.stage.is_last:
            dims = replace(dims, heads=self._heads())
        programs = compile_programs(
            dims,
            compile_options(self.vllm_config),
            on_device,
            f"{self.device.label}: programs",
        )
        self.ctx.programs = self.ctx.token_table.programs = programs
        if is_ngram:
            self.ctx.proposer = replace(self.ctx.proposer, programs=programs)
        elif self.draft is not None:
            self.draft.programs = programs

    @property
    def max_model_len(self) -> int:
        """vLLM's, which it lowers when the KV cache cannot hold the model's
        (``max_model_len=-1``) before any step runs."""
        return self.model_config.max_model_len

    def update_max_model_len(self, max_model_len: int) -> None:
        """The worker has set it in the config, which everything here reads."""
        assert max_model_len == self.max_model_len

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The newest sampling step's drafts, which came back with its output.
        Sync scheduling asks after every step. Async scheduling asks only to
        check the drafts of structured-output requests against their grammar,
        once the engine has read that step's output (so this waits for
        nothing); otherwise the drafts stay on the device and the scheduler
        only counts them. Only the output rank answers."""
        output, self._drafted = self._drafted, None
        if output is None or not self.is_output_rank:
            return None
        step_output = output.get()
        if not isinstance(step_output, DraftedOutput):
            return None  # a failed step
        # Copies: the scheduler trims them in place.
        return DraftTokenIds(
            list(step_output.req_ids),
            [list(drafts) for drafts in step_output.draft_token_ids],
        )

    def reload_weights(
        self,
        weights_iterator: Any = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        """vLLM's in-place reload of the target's weights (from disk, or from
        ``weights_iterator``), as a state update: after every execution
        enqueued before it, which read the old weights, and before any
        after it. Returns once it ran; its failure stops the engine (the
        weights are then unknown)."""
        from vllm.model_executor.model_loader.reload.inplace import (
            reload_weights,
        )

        self._update_weights(
            reload_weights,
            self.vllm_config,
            self.model,
            weights_iterator,
            weights_path,
            is_checkpoint_format,
        )

    def reset_weights(self) -> None:
        """vLLM's ``reset_weights`` (every weight zeroed), as a state update."""
        from vllm.model_executor.model_loader.weight_checksum import zero_weights

        self._update_weights(zero_weights, self.model)

    def _update_weights(self, update: Any, *args: Any) -> None:
        self.device.enqueue_state_update(torch.inference_mode()(update), *args)
        # Executions are FIFO: this one's result (or DeviceStateError, which
        # names the update's failure) says the update has run.
        self.device.enqueue(lambda: None).result()

    def get_draft_model(self) -> torch.nn.Module | None:
        return None if self.draft is None else self.draft.model

    def get_encoder_timing_stats(self) -> dict[str, dict[str, float | int]]:
        return {}  # text models only: no encoder

    # The adapter manager's calls, each an execution in step order
    # (``worker/lora.py``); without --enable-lora, vLLM's error.
    def add_lora(self, lora_request: Any) -> bool:
        lora = self._adapters()
        return lora.run(lora.manager.add_adapter, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        lora = self._adapters()
        return lora.run(lora.manager.remove_adapter, lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        lora = self._adapters()
        return lora.run(lora.manager.pin_adapter, lora_id)

    def list_loras(self) -> set[int]:
        lora = self._adapters()
        return lora.run(lora.manager.list_adapters)

    def reset_lora_state(self) -> None:
        """After the base weights are replaced (vLLM's)."""
        if self.ctx.lora is not None:
            self.ctx.lora.run(self.ctx.lora.reset, self.model)

    def _adapters(self) -> Adapters:
        if self.ctx.lora is None:
            raise RuntimeError(_NO_LORA)
        return self.ctx.lora

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def get_async_scheduling_stats(self) -> dict[str, int]:
        return self.flow.stats()

    def set_step_timeline(self, is_on: bool) -> None:
        """Starts (a new, empty) or stops recording the step timeline."""
        if self.timeline is not None:
            self.flow.unsubscribe(self.timeline)
            self.timeline = None
        if is_on:
            self.timeline = StepTimeline()
            self.flow.subscribe(self.timeline)

    def get_rank_state(self) -> dict[str, Any]:
        """In-flight steps and a digest of the host token histories, after
        waiting for those steps: equal on every TP rank when no rank drifts."""
        num_in_flight = len(self.flow.in_flight)
        self.flow.drain()
        return {
            "tp_rank": self.tp_rank,
            "in_flight_steps": num_in_flight,
            "max_in_flight_steps": self.flow.max_in_flight,
            "finished_digest": self.digest.finished_hexdigest(),
            "num_requests": len(self.host.requests),
            "history_digest": self.host.history_digest(),
        }

    def shutdown(self) -> None:
        """Drains the device before the worker releases what it uses (the
        model, the KV cache, the process): at most two steps are queued."""
        self.device.shutdown(timeout_s=_SHUTDOWN_TIMEOUT_S)

    # ---- one step -----------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: "SchedulerOutput", intermediate_tensors: Any = None
    ) -> ModelRunnerOutput | None:
        """Enqueues the step's forward; None: ``sample_tokens`` follows."""
        with self._host_section("execute_model"):
            update = self.flow.begin_step(scheduler_output)
            self.kv_cache.zero_blocks(
                getattr(scheduler_output, "new_block_ids_to_zero", None)
            )
            if update.batch_change is not None:
                # Requests joined or left: the device's logits processors
                # and histories take it before anything samples.
                self.device.enqueue_state_update(
                    self.ctx.sampling.update, update.batch_change
                )
            if not scheduler_output.total_num_scheduled_tokens:
                # Nothing to run (the engine only tells of finished
                # requests): bring host state up to date where that costs
                # no wait, so an idle worker holds no step it need not.
                self.flow.retire_ready()
                return EMPTY_MODEL_RUNNER_OUTPUT
            kinds, ctx = self.step_kinds, self.ctx
            step = kinds.start(ctx, self.host, scheduler_output, update)
            if step.needs_host_tokens:
                # A prompt position holds a token still on the device (not
                # expected with these schedulers): wait for it, start again.
                self.flow.retire()
                step = kinds.start(ctx, self.host, scheduler_output, update)
            self._pending = _PendingStep(step, scheduler_output, update)
            return None

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: "GrammarOutput | None"
    ) -> ModelRunnerOutput | AsyncStepOutput:
        """Enqueues on-device sampling. Async: the output is a future the
        engine reads later; the sampled tokens feed later steps on device."""
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        with self._host_section("sample_tokens"):
            step = pending.step
            result, output = step.enqueue_sampling(
                self.ctx,
                pending.update,
                None
                if grammar_output is None
                else (pending.scheduler_output, grammar_output),
            )
            # Placeholders once sampling is enqueued: it reads the histories
            # as they were (at enqueue, or the snapshot).
            placeholders = self.host.add_placeholders(step.req_ids, step.num_new_tokens)
            in_flight = InFlightStep(self.flow.step, result, output, placeholders)
            if not self.is_output_rank:
                result.add_done_callback(_stop_rank_if_failed)
            step_output = self.flow.end_step(in_flight, step.shape, step.num_table_rows)
            if step.drafts:
                self._drafted = output
            return step_output

    def _host_section(self, name: str) -> AbstractContextManager[None]:
        """Times the section for the timed observers (the step timeline of
        the benchmarks), if any."""
        if not self.flow.timed:
            return nullcontext()
        return self.flow.host_section(name)

    def get_compiled_shapes(self) -> dict[str, Any]:
        """The forward's declared token counts and graphs, and each compiled
        program's graphs (dynamo's cache entries: a recompile adds one) and
        the calls it has served since start-up."""
        models = self._models()
        compiled = [
            p
            for p in vars(self.ctx.programs).values()
            if isinstance(p, CompiledProgram)
        ]
        return {
            "declared": getattr(models[0], "declared_shapes", None),
            "forward_graphs": forward_graphs(models),
            "program_shapes": {p.name: p.num_shapes for p in compiled},
            "program_graphs": {p.name: p.graphs() for p in compiled},
            "program_calls": {p.name: p.calls for p in compiled},
        }

    def _heads(self) -> tuple[Head, ...]:
        """The models whose LM head steps run, with their hidden states'
        shape: the target, then the draft model where there is one."""
        heads = [Head.of(self.model, self.model_config)]
        if self.draft is not None:
            spec_config = self.vllm_config.speculative_config
            assert spec_config is not None
            heads.append(Head.of(self.draft.model, spec_config.draft_model_config))
        return tuple(heads)

    def _models(self) -> list[torch.nn.Module]:
        """The target, then the draft model where there is one."""
        return [self.model] + ([] if self.draft is None else [self.draft.model])

    def _dummy_forward(self, num_tokens: int) -> None:
        stage = self.ctx.stage
        with (
            torch.inference_mode(),
            set_forward_context(None, self.vllm_config, num_tokens=num_tokens),
        ):
            for model in self._models():
                kwargs: dict[str, Any] = {}
                if not stage.is_first:
                    # Zeros at the shape: compiling needs no peer.
                    kwargs["intermediate_tensors"] = empty_hidden(model, num_tokens)
                model(
                    input_ids=torch.zeros(num_tokens, dtype=torch.int32),
                    positions=torch.zeros(num_tokens, dtype=torch.int64),
                    **kwargs,
                )
