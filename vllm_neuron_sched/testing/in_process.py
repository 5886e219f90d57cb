"""vLLM engines whose engine core and worker run in this process.

Such an engine starts in seconds (no processes to spawn, no queues between
them) and runs the same ``EngineCore.step()`` / ``step_with_batch_queue()``
as a served one, so tests that need many engines of one worker each build
them this way. Engines built outside keep vLLM's default.
"""

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextmanager
def in_process() -> Iterator[None]:
    """Engines built inside the block run in this process. The engine core
    freezes vLLM's environment cache when it starts: undone on the way out,
    so later engines read the environment again."""
    import vllm.envs as vllm_envs

    saved = os.environ.get(_MULTIPROCESSING)
    os.environ[_MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[_MULTIPROCESSING]
        else:
            os.environ[_MULTIPROCESSING] = saved
        vllm_envs.disable_envs_cache()


@contextmanager
def in_process_llm(
    model: str, start_env: dict[str, str] | None = None, **engine_kwargs: Any
) -> Iterator[Any]:
    """An ``LLM`` run in this process, shut down (its KV cache freed) when
    the block ends. ``start_env``: variables set while it starts (what its
    workers read then), and only then, so oracle runs asked for later key
    on this process's own environment.

    vLLM's multiprocessing executor sets this process's torch threads to 1
    for good (``set_torch_threads_for_runtime``: its engine core only
    schedules); restored, or a later engine whose worker runs in this
    process would run its attention with fewer threads than its metadata
    was built for (``cpu_attn``: ``thread_num (2 vs. 1)``)."""
    import torch
    from vllm import LLM

    num_threads = torch.get_num_threads()
    with in_process(), mock.patch.dict(os.environ, start_env or {}):
        llm = LLM(model=model, **engine_kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        _unpin_executor(llm)
        del llm
        gc.collect()
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)


def _unpin_executor(llm: Any) -> None:
    """vLLM's multiprocessing executor registers ``weakref.finalize(self,
    self.shutdown)``: the bound method keeps the executor, and with it its
    ``VllmConfig``, alive until the process exits. Shut down, it is dropped,
    or the platform would go on counting its engine among those alive when
    it validates later engines' requests."""
    engine_core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    finalizer = getattr(
        getattr(engine_core, "model_executor", None), "_finalizer", None
    )
    if finalizer is not None:
        finalizer.detach()
