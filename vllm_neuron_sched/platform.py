"""The platform: vLLM's CPU platform with asynchronous scheduling kept on.

vLLM's CPU platform forces ``async_scheduling = False``. We keep the user's
choice (vLLM's default resolution: on for generation, off for pooling), pick the
scheduler and worker for it, and validate requests against the static-shape
limits at the API boundary, where a bad request gets a 400 instead of stalling
the engine.
"""

import os
import weakref
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_neuron_sched import envs
from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.core.limits import RequestLimits
from vllm_neuron_sched.metrics import setup_metrics_export
from vllm_neuron_sched.unsupported import check_config, request_error

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.inputs import EngineInput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.utils.argparse_utils import FlexibleArgumentParser

logger = init_logger(__name__)

_SCHED = "vllm_neuron_sched.core.scheduler"
CHUNKED_PREFILL_SCHEDULER = f"{_SCHED}.ChunkedPrefillScheduler"
ASYNC_CHUNKED_PREFILL_SCHEDULER = f"{_SCHED}.AsyncChunkedPrefillScheduler"
POOLING_SCHEDULER = f"{_SCHED}.PoolingScheduler"
WORKER = "vllm_neuron_sched.worker.worker.NeuronSchedWorker"
# The decode batch is rectangular in blocks of this many tokens (tkv blocks).
DEFAULT_BLOCK_SIZE = 64


def compile_per_shape_in_runner(vllm_config: "VllmConfig") -> None:
    """The compiled device: our runner compiles the model itself, one graph
    per declared shape (``worker/compiled.py``), where vLLM's CPU platform
    would trace it once with a dynamic token count and no guards."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if vllm_config.lora_config is not None:
        # vLLM's LoRA layers run eager on the CPU (its platform turns
        # compilation off for them).
        raise ValueError(
            "VLLM_NEURON_SCHED_DEVICE=compiled cannot run LoRA adapters "
            "(--enable-lora): use the thread or inline device with them"
        )
    if compilation.mode == CompilationMode.NONE:
        raise ValueError(
            "VLLM_NEURON_SCHED_DEVICE=compiled compiles the forward once per "
            "declared shape at start-up; it cannot run with --enforce-eager "
            "(compilation mode none): drop one or the other"
        )
    compilation.mode = CompilationMode.STOCK_TORCH_COMPILE


def workers_on_this_node(parallel_config: "ParallelConfig") -> int:
    """This node's share of one replica's ranks (multi-node TP), times the
    replicas it runs (data parallel): the workers that need cores here."""
    return parallel_config.local_world_size * max(
        parallel_config.data_parallel_size_local, 1
    )


def check_thread_binding(num_local_workers: int) -> None:
    """Fails fast, in the front end, where vLLM's automatic OpenMP binding
    would fail inside the engine: ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds
    each worker to a NUMA node of its own, so more workers than NUMA nodes
    (TP=4 on a 2-core laptop) end in an assertion in the spawned engine core
    that does not say which variable to set."""
    from vllm import envs as vllm_envs
    from vllm.utils.cpu_resource_utils import (
        get_allowed_cpu_list,
        get_visible_memory_node,
    )

    if (
        num_local_workers <= 1
        or vllm_envs.VLLM_CPU_OMP_THREADS_BIND != "auto"
        or os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0"
    ):
        return
    num_nodes = len(get_visible_memory_node())
    if num_local_workers <= num_nodes:
        return
    cpus = [cpu.id for cpu in get_allowed_cpu_list()]
    binding = thread_binding(num_local_workers, cpus)
    raise ValueError(
        f"{num_local_workers} CPU workers on this node (tensor x pipeline "
        "parallel ranks here, times data-parallel replicas) but "
        f"{num_nodes} NUMA node(s) and {len(cpus)} usable core(s): vLLM's "
        "automatic thread binding needs a NUMA node per worker. Bind the "
        "workers' OpenMP threads yourself, one '|'-separated core list per "
        f'worker, e.g. VLLM_CPU_OMP_THREADS_BIND="{binding}" (workers may '
        "share cores), or VLLM_CPU_OMP_THREADS_BIND=nobind."
    )


def check_environment(vllm_config: "VllmConfig") -> None:
    """Every VLLM_NEURON_SCHED_* value, at start-up in the front end: a value
    that cannot be parsed, or that cannot work with this configuration, is
    refused here with its name, not later inside a worker."""
    from vllm_neuron_sched.core.limits import parse_pooling_shapes
    from vllm_neuron_sched.core.prefill_shapes import engine_prefill_shapes
    from vllm_neuron_sched.worker.buckets import parse_decode_buckets

    envs.check_values()
    scheduler_config = vllm_config.scheduler_config
    max_num_seqs = scheduler_config.max_num_seqs
    parse_decode_buckets(envs.VLLM_NEURON_SCHED_DECODE_BUCKETS, max_num_seqs)
    if vllm_config.model_config is not None:
        max_model_len = vllm_config.model_config.max_model_len
        parse_pooling_shapes(
            envs.VLLM_NEURON_SCHED_POOLING_SHAPES, max_model_len, max_num_seqs
        )
        engine_prefill_shapes(vllm_config)


def check_pipeline_stages(vllm_config: "VllmConfig") -> None:
    """A stage holds at least one layer (vLLM splits them; with none a
    stage has no KV cache and the engine fails deep in its start)."""
    stages = vllm_config.parallel_config.pipeline_parallel_size
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    if stages > layers:
        raise ValueError(
            f"--pipeline-parallel-size {stages} is more than the model's {layers} "
            "layers: every stage needs one"
        )


def check_speculation(vllm_config: "VllmConfig") -> None:
    """Start-up check of ``--speculative-config``: the n-gram proposer on the
    device, and a scheduler that never mixes prefill and decode (a verify
    step holds decode rows only)."""
    from vllm_neuron_sched.core.chunked_prefill import ChunkedPrefillMixin
    from vllm_neuron_sched.worker.spec.config import Speculation

    Speculation.from_config(vllm_config)
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if isinstance(scheduler_cls, str):
        from vllm.utils.import_utils import resolve_obj_by_qualname

        scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
    if not (
        isinstance(scheduler_cls, type)
        and issubclass(scheduler_cls, ChunkedPrefillMixin)
    ):
        raise ValueError(
            "speculative decoding on vllm_neuron_sched needs one of its chunked-"
            f"prefill schedulers (--scheduler-cls {CHUNKED_PREFILL_SCHEDULER} or "
            f"{ASYNC_CHUNKED_PREFILL_SCHEDULER}); got {scheduler_cls!r}"
        )


# vLLM's V1-runner check names what vLLM's own V1 runner cannot run.
_V1_RUNNER_PP_ASYNC = "pipeline parallelism with async scheduling"


def let_our_runner_run_async_pipelines() -> None:
    """vLLM refuses async scheduling with pipeline parallel for its V1 model
    runner (its check runs after this platform's, with no hook between). Our
    runner takes that runner's place and runs it (docs/design.md section 14),
    so for a configuration whose worker is ours the check drops that one
    entry; every other entry, and every other configuration, is vLLM's."""
    from vllm.config import VllmConfig

    check = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(check, "lets_our_runner_pipeline", False):
        return

    def unsupported(config: "VllmConfig") -> list[str]:
        found = check(config)
        if config.parallel_config.worker_cls == WORKER:
            found = [feature for feature in found if feature != _V1_RUNNER_PP_ASYNC]
        return found

    unsupported.lets_our_runner_pipeline = True  # type: ignore[attr-defined]
    VllmConfig._get_v1_model_runner_unsupported_features = unsupported  # type: ignore[method-assign]


class NeuronSchedPlatform(CpuPlatform):
    # id(VllmConfig) -> its request limits, for every configuration alive in
    # this process (set in check_and_update_config, dropped with the config):
    # read by validate_request, which vLLM calls without the configuration.
    _request_limits: dict[int, RequestLimits] = {}
    # id(VllmConfig) -> the configuration, whose max_model_len vLLM lowers to
    # what the KV cache holds (max_model_len=-1) after the check.
    _configs: dict[int, "weakref.ref[VllmConfig]"] = {}
    # Workers on this node; set by each of our workers for its own process.
    _workers_per_node: int = 1

    @classmethod
    def device_count(cls) -> int:
        """Devices on this node: on a CPU, one per worker.

        vLLM tells the ranks that share a node by ``rank // device_count()``
        (the single-reader queues of multi-node TP, ``shm_broadcast``). The
        CPU platform's answer, torch's constant 1, makes every rank a node of
        its own, and a multi-node start with two workers per node fails on an
        assertion in ``MultiprocExecutor``.
        """
        return cls._workers_per_node

    @classmethod
    def set_workers_per_node(cls, num_workers: int) -> None:
        cls._workers_per_node = num_workers

    @classmethod
    def pre_register_and_update(
        cls, parser: "FlexibleArgumentParser | None" = None
    ) -> None:
        """With a parser: an OpenAI server is starting in this process, the
        one place whose ``/metrics`` shows our counters. Once per process,
        before the engine is spawned (the workers inherit the directory)."""
        super().pre_register_and_update(parser)
        if parser is not None:
            setup_metrics_export()

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        check_environment(vllm_config)
        scheduler_config = vllm_config.scheduler_config
        parallel_config = vllm_config.parallel_config
        cache_config = vllm_config.cache_config
        model_config = vllm_config.model_config

        requested_async = bool(scheduler_config.async_scheduling)
        user_worker = parallel_config.worker_cls != "auto"
        is_pooling = model_config is not None and model_config.runner_type == "pooling"
        runs_our_runner = parallel_config.worker_cls in ("auto", WORKER)
        if is_pooling and parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "vllm_neuron_sched runs pooling models on vLLM's own CPU runner, "
                "which does not run pipeline parallel "
                "(--pipeline-parallel-size > 1): use --tensor-parallel-size or "
                "--data-parallel-size"
            )
        if runs_our_runner and not is_pooling and model_config is not None:
            # Our runner runs: what it does not run is refused first. It
            # speaks vLLM's V1 runner protocol, so V2 only where asked for.
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
            check_config(vllm_config)
            check_pipeline_stages(vllm_config)
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
            cache_config.user_specified_block_size = True

        super().check_and_update_config(vllm_config)
        check_thread_binding(workers_on_this_node(parallel_config))
        if (
            runs_our_runner
            and not is_pooling
            and envs.VLLM_NEURON_SCHED_DEVICE == "compiled"
        ):
            compile_per_shape_in_runner(vllm_config)

        if is_pooling and requested_async:
            logger.info_once(
                "Async scheduling is off for pooling models: a pooling step "
                "produces no token to run ahead on, so it only adds latency."
            )
        scheduler_config.async_scheduling = requested_async and not is_pooling

        if not is_pooling:
            # Our schedulers split prompts into chunks themselves.
            scheduler_config.enable_chunked_prefill = True
        if scheduler_config.scheduler_cls is None:
            if is_pooling:
                scheduler_config.scheduler_cls = POOLING_SCHEDULER
            elif scheduler_config.async_scheduling:
                scheduler_config.scheduler_cls = ASYNC_CHUNKED_PREFILL_SCHEDULER
            else:
                scheduler_config.scheduler_cls = CHUNKED_PREFILL_SCHEDULER
        if not user_worker:
            parallel_config.worker_cls = WORKER
        if vllm_config.speculative_config is not None:
            check_speculation(vllm_config)
        if parallel_config.worker_cls == WORKER:
            let_our_runner_run_async_pipelines()

        if model_config is not None:
            key = id(vllm_config)
            cls._request_limits[key] = RequestLimits.from_config(vllm_config)
            cls._configs[key] = weakref.ref(vllm_config)
            weakref.finalize(vllm_config, cls._request_limits.pop, key, None)
            weakref.finalize(vllm_config, cls._configs.pop, key, None)
        logger.info(
            "vllm_neuron_sched: async_scheduling=%s scheduler=%s worker=%s",
            scheduler_config.async_scheduling,
            scheduler_config.scheduler_cls,
            parallel_config.worker_cls,
        )

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm_neuron_sched.worker.lora.MaskedPunicaWrapperCPU"

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM flags every unknown ``VLLM_*`` variable; ours are known."""
        from vllm import envs as vllm_envs

        from vllm_neuron_sched import envs

        known = vllm_envs.environment_variables.keys() | envs.environment_variables
        for name in os.environ:
            if name.startswith("VLLM_") and name not in known:
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable: {name}")
                logger.warning("Unknown vLLM environment variable: %s", name)

    @classmethod
    def validate_request(
        cls,
        processed_inputs: "EngineInput",
        params: "SamplingParams | PoolingParams",
    ) -> None:
        """Refuses a request that no engine of this process could ever run.
        vLLM does not say which engine a request is for: with several engines
        alive, one whose own limits it exceeds finishes it with an error."""
        super().validate_request(processed_inputs, params)
        prompt_ids = processed_inputs.get("prompt_token_ids") or []
        max_tokens = getattr(params, "max_tokens", None)
        if error := request_error(params):
            raise ValueError(error)
        errors = [
            limits.check(len(prompt_ids), max_tokens) or limits.check_sampling(params)
            for limits in cls._live_request_limits()
        ]
        if errors and all(errors):
            raise ValueError(errors[-1])

    @classmethod
    def _live_request_limits(cls) -> list[RequestLimits]:
        """Each configuration's limits, made again where vLLM has lowered its
        max_model_len since they were made."""
        for key, limits in list(cls._request_limits.items()):
            config = cls._configs[key]()
            if config is not None and (
                config.model_config.max_model_len != limits.max_model_len
            ):
                cls._request_limits[key] = RequestLimits.from_config(config)
        return list(cls._request_limits.values())
