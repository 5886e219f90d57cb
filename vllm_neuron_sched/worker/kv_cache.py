"""The KV cache, set up with vLLM's own helpers.

The engine asks for the spec (``spec``), sizes the cache, then has it
allocated (``allocate``): we allocate and bind it as vLLM does and create the
platform attention backend's metadata builders. Afterwards only device
executions touch it.
"""

from typing import TYPE_CHECKING

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    bind_kv_cache,
    customize_attention_spec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_neuron_sched.runtime import Device


class KVCache:
    def __init__(
        self, vllm_config: "VllmConfig", torch_device: torch.device, device: "Device"
    ) -> None:
        self.vllm_config = vllm_config
        self.torch_device = torch_device
        self.device = device
        self.caches: list[torch.Tensor] = []
        self.attn_groups: list[AttentionGroup] = []

    def spec(self) -> dict[str, KVCacheSpec]:
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

    def allocate(self, kv_cache_config: KVCacheConfig) -> list[int]:
        """Allocates and binds the cache; returns each group's block size."""
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
            attn_group.create_metadata_builders(self.vllm_config, self.torch_device)
            self.attn_groups.append(attn_group)
            block_sizes.append(spec.block_size)

        kv_caches = allocate_kv_cache(
            kv_cache_config,
            self.torch_device,
            self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
            block_sizes,
        )
        bind_kv_cache(
            kv_caches,
            self.vllm_config.compilation_config.static_forward_context,
            self.caches,
            kv_cache_groups=groups,
        )
        return block_sizes

    def zero_blocks(self, block_ids: list[int] | None) -> None:
        """Zeroes freshly allocated blocks on the device, after every earlier
        execution (one may still write the blocks' previous owner's KV)."""
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.int64)
            self.device.enqueue_state_update(_zero_blocks, list(self.caches), index)


def _zero_blocks(kv_caches: list[torch.Tensor], index: torch.Tensor) -> None:
    seen: set[int] = set()
    for kv in kv_caches:
        if kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            kv.index_fill_(0, index, 0)
