"""The compiled device's contract on a small module (no engine): one graph per
declared shape, compiled before serving; a graph break fails the warm-up; a
shape nobody declared fails its forward, naming the model and the shapes."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from vllm_neuron_sched.core.prefill_shapes import PrefillShape
from vllm_neuron_sched.worker.buckets import Buckets
from vllm_neuron_sched.worker.compiled import (
    ShapeNotCompiledError,
    declared_shape,
    forward_graphs,
    forward_sizes,
    warm_up,
)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class DataDependent(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A per-row host read: what a step's program must not contain.
        return super().forward(x[: int(x[0, 0].item() > 0) + 1])


def _here(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    model.compile(fullgraph=True, dynamic=False, backend="eager")
    return model


def test_one_graph_per_declared_shape_then_no_other() -> None:
    model = _compiled(Mlp())
    before = forward_graphs([model])
    warm_up([model], (2, 4), lambda n: model(torch.randn(n, 8)), _here, "mlp")
    assert forward_graphs([model]) - before == 2
    x = torch.randn(4, 8)
    with declared_shape(model, 4):
        assert torch.allclose(model(x), Mlp.forward(model, x))
    assert forward_graphs([model]) - before == 2  # served from its graph
    with (
        pytest.raises(ShapeNotCompiledError, match=r"Mlp ran at 3 tokens.*\[2, 4\]"),
        declared_shape(model, 3),
    ):
        model(torch.randn(3, 8))
    # Outside a declared forward, torch compiles as it always does.
    model(torch.randn(3, 8))
    assert forward_graphs([model]) - before == 3


def test_more_shapes_than_dynamos_default_limit() -> None:
    """vLLM's declared grids run to a dozen shapes and more; dynamo keeps 8
    graphs per function unless told otherwise, in a config it keeps per
    thread: the device's thread here, as in the runner."""
    model = _compiled(Mlp())
    sizes = tuple(range(1, 21))
    device = ThreadPoolExecutor(1)

    def on_device(fn: Callable[..., Any], *args: Any) -> Any:
        return device.submit(fn, *args).result()

    warm_up([model], sizes, lambda n: model(torch.randn(n, 8)), on_device, "mlp")

    def serve(size: int) -> None:
        with declared_shape(model, size):
            model(torch.randn(size, 8))

    for size in sizes:
        on_device(serve, size)
    device.shutdown()


def test_a_graph_break_fails_the_warm_up() -> None:
    model = _compiled(DataDependent())
    with pytest.raises(Exception, match="(?i)graph break|item|data-dependent"):
        warm_up(
            [model], (2,), lambda n: model(torch.ones(n, 8)), _here, "data-dependent"
        )


def test_forward_sizes_cover_every_step_kind() -> None:
    buckets = Buckets(
        decode=(1, 2, 4),
        prefill=(16, 32),
        prefill_shapes=(PrefillShape(2, 8), PrefillShape.packed_row(24)),
    )
    # decode rows, verify rows of 1 + K = 4 queries, prefill shapes, buckets
    assert forward_sizes(buckets, 4) == (1, 2, 4, 8, 16, 24, 32)
    assert forward_sizes(buckets, 1) == (1, 2, 4, 16, 24, 32)


def _config(checkpoint_dir: str, **model: object) -> object:
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=checkpoint_dir,
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
            **model,
        )
    )


def test_the_compiled_device_compiles_in_the_runner_and_refuses_eager_and_lora(
    checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our runner compiles per shape (stock's compile mode, which vLLM's CPU
    platform leaves alone); eager mode has nothing to compile: refused at
    start-up."""
    from vllm.config import CompilationMode

    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "compiled")
    config = _config(checkpoint_dir)
    assert config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
    with pytest.raises(ValueError, match="cannot run with --enforce-eager"):
        _config(checkpoint_dir, enforce_eager=True)
    # vLLM's LoRA layers run eager on the CPU.
    from vllm.engine.arg_utils import EngineArgs

    lora = EngineArgs(
        model=checkpoint_dir, max_model_len=256, enable_lora=True, max_lora_rank=8
    )
    with pytest.raises(ValueError, match="cannot run LoRA adapters"):
        lora.create_engine_config()
