"""The KV cache, set up with vLLM's own helpers.

The engine asks for the spec (``spec``), sizes the cache, then has it
allocated (``allocate``): we allocate and bind it as vLLM does and create the
platform attention backend's metadata builders. Afterwards only device
executions touch it.

A draft model's attention layers (speculative decoding, ``draft_model.py``)
are in the spec like the target's, so vLLM sizes and allocates their cache
with the same block ids: a request's blocks hold its target and its draft KV.
They get attention groups of their own (``draft_groups``), since the draft
runs in forwards of its own.
"""

from typing import TYPE_CHECKING

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    bind_kv_cache,
    customize_attention_spec,
)

# Where a draft model's layers are registered (vLLM's prefix for its own).
DRAFT_PREFIX = "draft_model"

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
        self.attn_groups: list[AttentionGroup] = []  # the target model's
        self.draft_groups: list[AttentionGroup] = []  # a draft model's

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
        """Allocates and binds the cache; returns each group's block size.
        A group whose layers differ in shape (a draft model's heads; vLLM's
        ``UniformTypeKVCacheSpecs``) gets an attention group per shape."""
        groups = kv_cache_config.kv_cache_groups
        block_sizes = []
        for gid, group in enumerate(groups):
            specs = group.kv_cache_spec
            layer_specs = (
                specs.kv_cache_specs
                if isinstance(specs, UniformTypeKVCacheSpecs)
                else dict.fromkeys(group.layer_names, specs)
            )
            by_kind: dict[tuple[bool, KVCacheSpec], list[str]] = {}
            for name in group.layer_names:
                spec = layer_specs[name]
                if not isinstance(spec, AttentionSpec):
                    raise ValueError(
                        f"vllm_neuron_sched supports attention only: {spec}"
                    )
                by_kind.setdefault((is_draft_layer(name), spec), []).append(name)
            for (is_draft, spec), names in by_kind.items():
                layers = get_layers_from_vllm_config(
                    self.vllm_config, AttentionLayerBase, names
                )
                backend = next(iter(layers.values())).get_attn_backend()
                attn_group = AttentionGroup(backend, names, spec, gid)
                attn_group.create_metadata_builders(self.vllm_config, self.torch_device)
                (self.draft_groups if is_draft else self.attn_groups).append(attn_group)
            block_sizes.append(specs.block_size)

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


def is_draft_layer(layer_name: str) -> bool:
    """The draft model's layers are registered under its prefix."""
    return layer_name.startswith(f"{DRAFT_PREFIX}.")


def _zero_blocks(kv_caches: list[torch.Tensor], index: torch.Tensor) -> None:
    seen: set[int] = set()
    for kv in kv_caches:
        if kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            kv.index_fill_(0, index, 0)
