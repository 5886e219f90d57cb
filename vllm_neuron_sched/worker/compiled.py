"""The forward as a static-shape compiler makes it: one graph per declared
shape, all compiled before serving (the ``compiled`` device backend).

A Neuron or Spyre port compiles a graph per bucket when the model loads and
treats a shape nobody declared as an error. ``torch.compile(fullgraph=True,
dynamic=False)`` holds the same contract on the CPU: a graph break fails the
warm-up, each declared token count gets a graph of its own, and once serving
starts, torch's ``fail_on_recompile`` stance (around each forward, not
process-wide) turns a new shape into an error that names the model and the
shape (docs/design.md, section 9).
"""

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.exc import RecompileError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_neuron_sched.worker.buckets import Buckets

logger = init_logger(__name__)


class ShapeNotCompiledError(RuntimeError):
    """A forward at a shape no graph was compiled for at start-up."""


def compile_per_shape(model: torch.nn.Module, vllm_config: "VllmConfig") -> None:
    """Wraps ``model`` (in place) so that each input shape is a graph of its
    own, traced whole; vLLM's configured backend (inductor by default, with
    the options stock's compile gets) makes the graphs."""
    from vllm.env_override import _apply_constrain_to_fx_strides_patch

    _apply_constrain_to_fx_strides_patch()  # as vLLM does before compiling
    compilation = vllm_config.compilation_config
    backend = compilation.init_backend(vllm_config)
    # Inductor gets the options vLLM's CPU platform tunes for stock's graph.
    options = compilation.inductor_compile_config if backend == "inductor" else None
    model.compile(fullgraph=True, dynamic=False, backend=backend, options=options)


def forward_sizes(buckets: "Buckets", verify_width: int) -> tuple[int, ...]:
    """Every token count a forward runs at: decode buckets (one query per
    row, and ``verify_width`` queries per row in a verify step or a draft
    model's ingest), the declared prefill shapes and the token-count
    buckets of steps no prefill shape holds."""
    widths = {1, verify_width}
    sizes = {rows * width for rows in buckets.decode for width in widths}
    sizes.update(buckets.prefill)
    sizes.update(shape.size for shape in buckets.prefill_shapes)
    return tuple(sorted(sizes))


def forward_graphs(models: Iterable[torch.nn.Module]) -> int:
    """The graphs dynamo holds for these models' forwards (its cache entries
    per code object): one per declared shape after the warm-up, and no more
    while serving."""
    codes = {type(model).forward.__code__ for model in models}
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def warm_up(
    models: list[torch.nn.Module],
    sizes: Iterable[int],
    forward_at: Callable[[int], Any],
    on_device: Callable[..., Any],
    what: str,
) -> None:
    """Compiles a graph per size for each of ``models`` (``forward_at(size)``
    runs their forwards there; ``on_device(fn, *args)`` runs ``fn`` where the
    forwards run and waits), checks that a second pass compiles nothing, and
    from then on holds each model to those sizes (``declared_shape``)."""
    sizes = tuple(sizes)
    # A graph per size for each model (a draft of the target's class shares
    # its code, and dynamo's limit counts graphs per code object).
    on_device(_allow_graphs, len(sizes) * len(models))
    graphs_before, start = forward_graphs(models), time.perf_counter()
    for size in sizes:
        on_device(forward_at, size)
    compiled = forward_graphs(models) - graphs_before
    for size in sizes:
        on_device(forward_at, size)
    if more := forward_graphs(models) - graphs_before - compiled:
        raise RuntimeError(
            f"{what}: a second pass over the declared shapes compiled {more} "
            "more graph(s): a guard depends on something other than the shape"
        )
    for model in models:
        model.declared_shapes = sizes
    logger.info(
        "%s: compiled %d graph(s) for %d declared token counts %s in %.1f s",
        what,
        compiled,
        len(sizes),
        list(sizes),
        time.perf_counter() - start,
    )


def _allow_graphs(num_graphs: int) -> None:
    """Dynamo's per-function graph limit (8 by default), which its config
    keeps per thread: set on the thread that compiles."""
    if torch._dynamo.config.recompile_limit < num_graphs:
        torch._dynamo.config.recompile_limit = num_graphs


@contextmanager
def declared_shape(model: torch.nn.Module, num_tokens: int) -> Iterator[None]:
    """A model ``warm_up`` compiled runs only its graphs here: a shape that
    would compile is an error naming the model and the shape."""
    sizes = getattr(model, "declared_shapes", None)
    if sizes is None:
        yield
        return
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as error:  # torch 2.13's names the stance
        if not isinstance(error, RecompileError) and "fail_on_recompile" not in str(
            error
        ):
            raise
        raise ShapeNotCompiledError(
            f"compiled device: {type(model).__name__} ran at {num_tokens} "
            f"tokens, a shape not compiled at start-up (declared: {list(sizes)})"
        ) from error
