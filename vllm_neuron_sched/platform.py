"""The platform: vLLM's CPU platform with asynchronous scheduling kept on.

vLLM's CPU platform forces ``async_scheduling = False``. We keep the user's
choice (vLLM's default resolution: on for generation, off for pooling), pick the
scheduler and worker for it, and validate requests against the static-shape
limits at the API boundary, where a bad request gets a 400 instead of stalling
the engine.
"""

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_neuron_sched.core.limits import RequestLimits

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.inputs import EngineInput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

_SCHED = "vllm_neuron_sched.core.scheduler"
CHUNKED_PREFILL_SCHEDULER = f"{_SCHED}.ChunkedPrefillScheduler"
ASYNC_CHUNKED_PREFILL_SCHEDULER = f"{_SCHED}.AsyncChunkedPrefillScheduler"
POOLING_SCHEDULER = f"{_SCHED}.PoolingScheduler"
WORKER = "vllm_neuron_sched.worker.worker.NeuronSchedWorker"
# The decode batch is rectangular in blocks of this many tokens (tkv blocks).
DEFAULT_BLOCK_SIZE = 64


class NeuronSchedPlatform(CpuPlatform):
    # Set in check_and_update_config, read by validate_request in the same
    # (front-end) process.
    _request_limits: RequestLimits | None = None

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        scheduler_config = vllm_config.scheduler_config
        parallel_config = vllm_config.parallel_config
        cache_config = vllm_config.cache_config
        model_config = vllm_config.model_config

        requested_async = bool(scheduler_config.async_scheduling)
        user_worker = parallel_config.worker_cls != "auto"
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
            cache_config.user_specified_block_size = True

        super().check_and_update_config(vllm_config)

        is_pooling = model_config is not None and model_config.runner_type == "pooling"
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

        if model_config is not None:
            cls._request_limits = RequestLimits.from_config(vllm_config)
        logger.info(
            "vllm_neuron_sched: async_scheduling=%s scheduler=%s worker=%s",
            scheduler_config.async_scheduling,
            scheduler_config.scheduler_cls,
            parallel_config.worker_cls,
        )

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
        super().validate_request(processed_inputs, params)
        if cls._request_limits is None:
            return
        prompt_ids = processed_inputs.get("prompt_token_ids") or []
        max_tokens = getattr(params, "max_tokens", None)
        error = cls._request_limits.check(len(prompt_ids), max_tokens)
        if error is not None:
            raise ValueError(error)
