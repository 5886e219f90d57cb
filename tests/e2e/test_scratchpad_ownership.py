"""An execution owns every buffer it reads until its future resolves, vLLM's
process-global CPU scratchpad included.

vLLM 0.32's CPU extension keeps one scratchpad per process; its ``realloc``
frees the old buffer, unlocked, when a request outgrows it. If the host thread
builds attention metadata (which may grow it) while the device thread runs a
forward that reads it, the forward reads freed memory: heap corruption about
one start in eight. ``native/always_move_scratchpad.c``, preloaded, moves the
buffer on every call and faults on any stale access, so the race is certain
wherever the code allows it, sync or async.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron_sched.testing.oracle import start_in_subprocess
from vllm_neuron_sched.testing.workloads import SMALL_ENGINE, greedy, token_prompts

pytestmark = pytest.mark.slow

SHIM_SOURCE = Path(__file__).parent / "native" / "always_move_scratchpad.c"
# Prompts longer than the 32-token chunk: their non-final chunks return from
# execute_model while the device still runs them, so even sync mode builds the
# next step's inputs during a forward.
PROMPT_LENGTHS = [70, 9, 45, 100, 20, 33]
MAX_TOKENS = [24, 30, 12, 18, 28, 16]


def _c_compiler() -> list[str]:
    """The system's C compiler, else zig's (the ``ziglang`` wheel in the test
    extra), so the README's set-up always provides one."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if candidate and (path := shutil.which(candidate.split()[0])):
            return [path]
    return [sys.executable, "-m", "ziglang", "cc"]


@pytest.fixture(scope="module")
def always_move_scratchpad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = tmp_path_factory.mktemp("native") / "libalways_move_scratchpad.so"
    command = [*_c_compiler(), "-shared", "-fPIC", "-O2", "-o", str(library)]
    subprocess.run([*command, str(SHIM_SOURCE)], check=True)
    return library


@pytest.fixture(scope="module")
def runs(
    checkpoint_dir: str,
    always_move_scratchpad: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Future[list[dict[str, Any]]], Path]]:
    """Both engines start at once (each is mostly one core's work): the run
    and the shim's log, per mode."""
    runs = {}
    for mode, async_scheduling in (("sync", False), ("async", True)):
        log = tmp_path_factory.mktemp(f"scratchpad_{mode}") / "threads.log"
        run = start_in_subprocess(
            checkpoint_dir,
            token_prompts(PROMPT_LENGTHS, stride=11, salt=7),
            greedy(MAX_TOKENS),
            {**SMALL_ENGINE, "async_scheduling": async_scheduling},
            env={
                "LD_PRELOAD": str(always_move_scratchpad),
                "SCRATCHPAD_LOG": str(log),
                # Two threads share the scratchpad only with a device thread.
                "VLLM_NEURON_SCHED_DEVICE": "thread",
            },
        )
        runs[mode] = (run, log)
    return runs


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generate_with_a_scratchpad_that_moves_on_every_realloc(
    runs: dict[str, tuple[Future[list[dict[str, Any]]], Path]], mode: str
) -> None:
    run, log = runs[mode]
    results = run.result()
    assert [len(r["token_ids"]) for r in results] == MAX_TOKENS
    # The library was interposed: the worker's scratchpad went through it.
    assert log.exists() and log.read_text().strip(), "the shim was never called"
