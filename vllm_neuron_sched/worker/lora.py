"""LoRA adapters on a static-shape step: vLLM's LoRA layers, its adapter
manager (adapters in ``max_loras`` fixed slots, an LRU cache of loaded ones)
and its CPU punica wrapper, driven by the step's executions.

The host knows which adapter each request uses, so a step's adapter mapping
is host data of the step's shape (``StepAdapters``: one adapter id per padded
token, one per logits row; 0 is the base model, and padding). Activating it
writes the adapters' weights into their slots and the wrapper's index
buffers, all state an execution in flight reads: so it runs on the device, at
the start of the step's forward execution (``Adapters.activate``), after
every execution enqueued before it; loading, pinning or removing an adapter
by RPC is an execution in the same order (the ownership rule)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_neuron_sched.runtime import Device
    from vllm_neuron_sched.worker.layout import Tokens


@dataclass(frozen=True)
class StepAdapters:
    """Host side: a step's adapters, at its static shape."""

    tokens: np.ndarray  # [num_tokens_padded] adapter id of each token, 0: none
    rows: np.ndarray  # [rows] adapter id of each logits row
    requests: "tuple[LoRARequest, ...]"


def step_adapters(
    batch: "InputBatch", tokens: "Tokens", num_tokens_padded: int
) -> StepAdapters:
    """Each real token takes its row's adapter, padding none; the logits rows
    are the batch's rows (one logits row each)."""
    per_row, requests = _row_adapters(batch)
    mapping = np.zeros(num_tokens_padded, dtype=np.int64)
    mapping[tokens.index] = per_row[tokens.row_of_token]
    return StepAdapters(mapping, per_row, requests)


def verify_adapters(
    batch: "InputBatch", num_rows_padded: int, width: int
) -> StepAdapters:
    """A verify step's: each row's ``width`` queries take its adapter, the
    padded rows none; a logits row per query of the real rows."""
    per_row, requests = _row_adapters(batch)
    per_query = np.repeat(per_row, width)
    mapping = np.zeros(num_rows_padded * width, dtype=np.int64)
    mapping[: len(per_query)] = per_query
    return StepAdapters(mapping, per_query, requests)


def _row_adapters(
    batch: "InputBatch",
) -> "tuple[np.ndarray, tuple[LoRARequest, ...]]":
    """Each row's adapter id (0: none) and the adapters the rows use."""
    per_row = batch.request_lora_mapping[: batch.num_reqs].astype(np.int64)
    used = set(per_row[per_row > 0].tolist())
    requests = tuple(
        request
        for lora_id, request in batch.lora_id_to_lora_request.items()
        if lora_id in used
    )
    return per_row, requests


class Adapters:
    """Device side: vLLM's LRU adapter manager of the worker."""

    def __init__(self, manager: Any, device: "Device") -> None:
        self.manager = manager
        self.device = device

    @classmethod
    def wrap(
        cls, model: torch.nn.Module, vllm_config: "VllmConfig", device: "Device"
    ) -> "tuple[torch.nn.Module, Adapters]":
        """The model with vLLM's LoRA layers in place of its linear ones."""
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
        from vllm.model_executor.models import supports_lora

        if not supports_lora(model):
            raise ValueError(
                f"{type(model).__name__} does not support LoRA in vLLM "
                "(--enable-lora): leave it out"
            )
        manager = LRUCacheWorkerLoRAManager(
            vllm_config, torch.device("cpu"), model.embedding_modules
        )
        return manager.create_lora_manager(model, vllm_config), cls(manager, device)

    def activate(self, step: StepAdapters) -> None:
        """Device side, before the step's forward: its adapters into slots
        (loaded on first use, the least recently used evicted), its mapping
        into the wrapper. vLLM's per-token (decode) kernels for every step:
        one gather per token at the step's shape, where its prefill kernels
        group tokens by sequence with a data-dependent shape."""
        from vllm.lora.layers import LoRAMapping

        mapping = LoRAMapping(
            step.tokens.tolist(), step.rows.tolist(), is_prefill=False
        )
        self.manager.set_active_adapters(set(step.requests), mapping)

    def reset(self, model: torch.nn.Module) -> None:
        """Device side, after the base weights were replaced: every adapter
        goes, and the LM head's LoRA layer forgets its mapping (vLLM's)."""
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

        self.manager.remove_all_adapters()
        for module in model.modules():
            if isinstance(module, LogitsProcessorWithLoRA):
                module.reset_sharded_to_full_mapping()

    def run(self, call: Any, *args: Any) -> Any:
        """``call`` (the manager's add, remove, pin, list; ``reset``) as an
        execution in step order; returns its answer."""
        return self.device.enqueue(call, *args).result()


class MaskedPunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper, except that a token with no adapter gets
    none. vLLM 0.32's torch ops index the slot stack with the base model's
    -1, which is the last slot: a base request batched beside an adapter's
    ran that adapter (always, with ``max_loras=1``). Here the LoRA input of
    such a token is zeroed (after the shrink, for the embedding and the
    logits before the expand), so it adds nothing. A step in which no token
    (no logits row) has an adapter skips the LoRA computation, as vLLM's
    prefill path does: the host knows it from the mapping."""

    def update_metadata(self, mapping: Any, *args: Any, **kwargs: Any) -> None:
        super().update_metadata(mapping, *args, **kwargs)
        self._no_adapter_token = (self.token_lora_indices == -1)[:, None]
        self._no_adapter_row = (self.sampler_indices == -1)[:, None]
        self._any_token = any(i > 0 for i in mapping.index_mapping)
        self._any_row = any(i > 0 for i in mapping.prompt_mapping)

    def add_lora_linear(self, *args: Any, **kwargs: Any) -> None:
        if self._any_token:
            super().add_lora_linear(*args, **kwargs)

    def add_shrink(self, y: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._any_token:
            super().add_shrink(y, x, *args, **kwargs)
        for out in y if isinstance(y, tuple) else (y,):
            out.masked_fill_(self._no_adapter_token, 0)

    def add_expand(self, *args: Any, **kwargs: Any) -> None:
        if self._any_token:
            super().add_expand(*args, **kwargs)

    def add_lora_embedding(
        self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        if not self._any_token:
            return
        x = x.masked_fill(self._no_adapter_token.view(-1, *[1] * (x.dim() - 1)), 0)
        super().add_lora_embedding(y, x, *args, **kwargs)

    def add_lora_logits(
        self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        if self._any_row:
            super().add_lora_logits(
                y, x.masked_fill(self._no_adapter_row, 0), *args, **kwargs
            )
