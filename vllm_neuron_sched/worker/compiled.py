"""The device's programs as a static-shape compiler makes them: one graph
per declared shape, all compiled before serving (the ``compiled`` device
backend): the forward per token count, and the programs around it
(``worker/programs.py``) per decode bucket.

A Neuron or Spyre port compiles a graph per bucket when the model loads and
treats a shape nobody declared as an error. ``torch.compile(fullgraph=True,
dynamic=False)`` holds the same contract on the CPU: a graph break fails the
warm-up, each declared token count gets a graph of its own, and once serving
starts, torch's ``fail_on_recompile`` stance (around each forward, not
process-wide) turns a new shape into an error that names the model and the
shape (docs/design.md, section 9).
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.exc import RecompileError
from vllm.logger import init_logger

from vllm_neuron_sched.worker.programs import PROGRAMS, Dimensions, Program, Programs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_neuron_sched.worker.buckets import Buckets

logger = init_logger(__name__)


class ShapeNotCompiledError(RuntimeError):
    """A program at a shape no graph was compiled for at start-up."""


def compile_options(vllm_config: "VllmConfig") -> dict[str, Any]:
    """vLLM's configured backend (inductor by default, with the options
    stock's compile gets), as ``torch.compile`` keywords."""
    from vllm.env_override import _apply_constrain_to_fx_strides_patch

    _apply_constrain_to_fx_strides_patch()  # as vLLM does before compiling
    compilation = vllm_config.compilation_config
    backend = compilation.init_backend(vllm_config)
    # Inductor gets the options vLLM's CPU platform tunes for stock's graph.
    options = compilation.inductor_compile_config if backend == "inductor" else None
    return {"fullgraph": True, "dynamic": False, "backend": backend, "options": options}


def compile_per_shape(model: torch.nn.Module, vllm_config: "VllmConfig") -> None:
    """Wraps ``model`` (in place) so that each input shape is a graph of its
    own, traced whole."""
    model.compile(**compile_options(vllm_config))


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
    graphs_before, start = forward_graphs(models), time.perf_counter()
    # A graph per size for each model (a draft of the target's class shares
    # its code, and dynamo's limit counts graphs per code object, those an
    # earlier engine in this process compiled included: fewer are compiled
    # where dynamo reuses them).
    on_device(_allow_graphs, graphs_before + len(sizes) * len(models))
    compiled = _compile_twice(
        partial(_run_each, on_device, forward_at, [(size,) for size in sizes]),
        lambda: forward_graphs(models),
        what,
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


def _compile_twice(
    every_shape: Callable[[], None], graphs: Callable[[], int], what: str
) -> int:
    """Runs every declared shape twice: the first pass compiles a graph per
    shape (or reuses one an earlier engine in this process compiled), the
    second must compile nothing. -> the graphs the first pass compiled."""
    before = graphs()
    every_shape()
    compiled = graphs() - before
    every_shape()
    if more := graphs() - before - compiled:
        raise RuntimeError(
            f"{what}: a second pass over the declared shapes compiled {more} "
            "more graph(s): a guard depends on something other than the shape"
        )
    return compiled


def _run_each(
    on_device: Callable[..., Any], fn: Callable[..., Any], calls: list[tuple[Any, ...]]
) -> None:
    for args in calls:
        on_device(fn, *args)


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
    with _only_compiled_graphs(
        lambda: (
            f"{type(model).__name__} ran at {num_tokens} tokens, a shape "
            f"not compiled at start-up (declared: {list(sizes)})"
        )
    ):
        yield


@contextmanager
def _only_compiled_graphs(what: Callable[[], str]) -> Iterator[None]:
    """Torch's ``fail_on_recompile`` stance, its error ours, saying ``what()``
    (made only then: the steps' hot path formats nothing)."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as error:  # torch 2.13's names the stance
        if not isinstance(error, RecompileError) and "fail_on_recompile" not in str(
            error
        ):
            raise
        raise ShapeNotCompiledError(f"compiled device: {what()}") from error


class CompiledProgram:
    """A program (``worker/programs.py``) compiled once per declared shape:
    its rows padded to the smallest declared size that holds them (a decode
    bucket, or a token count; copies of the last row, so padded rows compute
    on real data and write what the last row writes), its answer cut back;
    the device's tensors it writes in place (its first ``state`` arguments)
    as they are. Once ``compile_programs`` has warmed it up, a shape that
    would compile is an error naming the program."""

    def __init__(self, program: Program, sizes: tuple[int, ...], **options: Any):
        self.name = program.name
        self.sizes = sizes
        self.along = program.along
        self.state = program.state
        self.function = program.function
        self._compiled = torch.compile(program.function, **options)
        self.declared = False
        self.num_shapes = 0  # declared (``compile_programs``)
        self.calls = 0  # served since the warm-up

    def graphs(self) -> int:
        """Dynamo's cache entries for the program (an earlier engine's in
        this process included, which it reuses): a recompile adds one."""
        return len(_debug_get_cache_entry_list(self.function.__code__))

    def __call__(self, *args: Any) -> Any:
        state, per_row = args[: self.state], args[self.state :]
        rows = next(a.shape[0] for a in per_row if isinstance(a, torch.Tensor))
        if rows == 0:
            return self.function(*args)  # nothing to run
        size = next((size for size in self.sizes if size >= rows), None)
        if size is None:
            raise ShapeNotCompiledError(
                f"compiled device: program {self.name} at {rows} {self.along}, "
                f"more than the largest declared size ({self.sizes[-1]})"
            )
        # Dynamo guards on inference mode and on whether each input is an
        # inference tensor: both made the same for every call (the state's
        # tensors are made outside inference mode, ``DeviceTokens``).
        with torch.inference_mode():
            padded = [*state, *(_pad_rows(arg, size) for arg in per_row)]
            if not self.declared:
                return _cut_rows(self._compiled(*padded), rows)
            self.calls += 1
            with _only_compiled_graphs(
                lambda: (
                    f"program {self.name} at {size} {self.along}, arguments "
                    f"{_signature(padded)}, not compiled at start-up"
                )
            ):
                return _cut_rows(self._compiled(*padded), rows)


def _pad_rows(value: Any, rows: int) -> Any:
    """In inference mode: a tensor's rows padded with copies of its last, as
    an inference tensor (a copy where it was not one)."""
    if isinstance(value, torch.Tensor):
        missing = rows - value.shape[0]
        if missing:
            value = torch.cat([value, value[-1:].expand(missing, *value.shape[1:])])
        elif not value.is_inference():
            value = value.clone()
        return value.contiguous()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return dataclasses.replace(
            value, **{f.name: _pad_rows(getattr(value, f.name), rows) for f in fields}
        )
    return value


def _cut_rows(value: Any, rows: int) -> Any:
    if isinstance(value, tuple):
        return tuple(_cut_rows(item, rows) for item in value)
    return None if value is None else value[:rows]


def _signature(args: list[Any]) -> str:
    def one(arg: Any) -> str:
        if isinstance(arg, torch.Tensor):
            return f"{str(arg.dtype).removeprefix('torch.')}{list(arg.shape)}"
        if isinstance(arg, torch.nn.Module) or (
            dataclasses.is_dataclass(arg) and not isinstance(arg, type)
        ):
            return type(arg).__name__
        return repr(arg)

    return "(" + ", ".join(one(arg) for arg in args) + ")"


def compile_programs(
    dims: Dimensions,
    options: dict[str, Any],
    on_device: Callable[..., Any],
    what: str,
) -> Programs:
    """Compiles each program at each of its declared shapes (its
    ``examples``, on the device's thread), checks that a second pass compiles
    nothing, and returns the programs that hold the step to those graphs
    (``options``: torch.compile's, ``compile_options``), bad words laid out
    at their declared shape. A program with no shape here (the n-gram
    proposal without an n-gram proposer) stays eager."""
    examples = {p.name: list(p.examples(dims)) for p in PROGRAMS}
    declared = [p for p in PROGRAMS if examples[p.name]]
    compiled = {p.name: CompiledProgram(p, p.sizes(dims), **options) for p in declared}
    # Dynamo's limit counts an earlier engine's graphs too.
    on_device(
        _allow_graphs,
        max(len(examples[name]) + p.graphs() for name, p in compiled.items()),
    )
    start, new_graphs = time.perf_counter(), 0
    for name, program in compiled.items():
        program.num_shapes = len(examples[name])
        new_graphs += _compile_twice(
            partial(_run_each, on_device, program, examples[name]),
            program.graphs,
            f"{what}: {name}",
        )
        program.declared = True
    logger.info(
        "%s: %d declared shapes, %d graph(s) compiled in %.1f s (the rest "
        "reused from an earlier engine in this process): %s; eager: %s",
        what,
        sum(map(len, examples.values())),
        new_graphs,
        time.perf_counter() - start,
        ", ".join(f"{name} {len(examples[name])}" for name in compiled),
        ", ".join(p.name for p in PROGRAMS if p.name not in compiled) or "none",
    )
    return dataclasses.replace(Programs(), **compiled, bad_words_shape=dims.bad_words)
