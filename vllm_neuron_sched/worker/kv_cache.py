"""KV cache set-up and warm-up for the runner, with vLLM's own helpers.

The engine asks for the spec (``get_kv_cache_spec``), sizes the cache, then
calls ``initialize_kv_cache``: we allocate and bind it as vLLM does, create
the platform attention backend's metadata builders and the input batch (its
block tables need the block sizes).
"""

from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.config import CompilationMode, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu_input_batch import InputBatch
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    bind_kv_cache,
    customize_attention_spec,
)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig

logger = init_logger(__name__)


class KVCacheMixin:
    vllm_config: "VllmConfig"
    model: Any
    device: torch.device
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    vocab_size: int
    accelerator: Any

    def _init_kv_cache_state(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.attn_groups: list[AttentionGroup] = []
        self.input_batch: InputBatch = cast(InputBatch, None)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        for name, layer in layers.items():
            if getattr(layer, "kv_sharing_target_layer_name", None):
                raise ValueError("vllm_neuron_sched does not support KV sharing")
            if spec := layer.get_kv_cache_spec(self.vllm_config):
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(layer.get_attn_backend(), spec)
                specs[name] = spec
        return specs

    def initialize_kv_cache(
        self,
        kv_cache_config: KVCacheConfig,
        is_profiling: bool = False,
        kv_cache_allocation_context: "AbstractContextManager | None" = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        block_sizes = []
        for gid, group in enumerate(groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec):
                raise ValueError(f"vllm_neuron_sched supports attention only: {spec}")
            layers = get_layers_from_vllm_config(
                self.vllm_config, AttentionLayerBase, group.layer_names
            )
            backend = next(iter(layers.values())).get_attn_backend()
            attn_group = AttentionGroup(backend, group.layer_names, spec, gid)
            attn_group.create_metadata_builders(self.vllm_config, self.device)
            self.attn_groups.append(attn_group)
            block_sizes.append(spec.block_size)

        kv_caches = allocate_kv_cache(
            kv_cache_config,
            self.device,
            self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
            block_sizes,
        )
        bind_kv_cache(
            kv_caches,
            self.vllm_config.compilation_config.static_forward_context,
            self.kv_caches,
            kv_cache_groups=groups,
        )
        logits_processors = self.vllm_config.model_config.logits_processors
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            vocab_size=self.vocab_size,
            block_sizes=block_sizes,
            max_num_blocks_per_req=[cdiv(self.max_model_len, bs) for bs in block_sizes],
            logitsprocs=build_logitsprocs(
                self.vllm_config,
                self.device,
                False,
                False,
                tuple(logits_processors or ()),
            ),
            logitsprocs_need_output_token_ids=bool(logits_processors),
        )

    def zero_kv_blocks(self, block_ids: list[int]) -> None:
        """Zeroes freshly allocated blocks on the device, after every earlier
        execution (one may still write the blocks' previous owner's KV)."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        self.accelerator.enqueue_state_update(_zero_blocks, list(self.kv_caches), index)

    def warming_up_model(self) -> None:
        """Compiles the model for its general shape before serving (the CPU
        worker calls this while sizing memory)."""
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
        logger.info("Warming up model for compilation...")
        self.accelerator.enqueue(self._dummy_forward, self.max_num_tokens).result()
        logger.info("Warming up done.")

    def _dummy_forward(self, num_tokens: int) -> None:
        with (
            torch.inference_mode(),
            set_forward_context(None, self.vllm_config, num_tokens=num_tokens),
        ):
            self.model(
                input_ids=torch.zeros(num_tokens, dtype=torch.int32),
                positions=torch.zeros(num_tokens, dtype=torch.int64),
            )


def _zero_blocks(kv_caches: list[torch.Tensor], index: torch.Tensor) -> None:
    seen: set[int] = set()
    for kv in kv_caches:
        if kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            kv.index_fill_(0, index, 0)
