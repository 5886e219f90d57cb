"""The LM head as a device program: a model's ``compute_logits`` (vLLM's,
its tensor-parallel all-gather included, which dynamo traces as a functional
collective) at a step's rows, so that a compiler makes it one graph per
declared row count instead of running it eager at the real rows."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import ModelConfig


@dataclass(frozen=True)
class Head:
    """A model whose LM head steps run (the target's; a draft model's), and
    the hidden states it reads."""

    model: Any
    hidden_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: Any, model_config: "ModelConfig") -> "Head":
        return cls(model, model_config.get_hidden_size(), model_config.dtype)


def compute_logits(hidden_states: torch.Tensor, model: Any) -> torch.Tensor:
    """``[rows, vocab]`` logits of ``[rows, hidden]`` hidden states."""
    return model.compute_logits(hidden_states)
