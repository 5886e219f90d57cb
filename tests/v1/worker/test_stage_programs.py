"""A pipeline stage's transfers are programs (``worker/pipeline.py``): on two
real ranks (gloo), each traced whole at each declared shape, compiled per
shape as the compiled device does it, and what crosses arrives intact."""

import multiprocessing
import os
import tempfile
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_neuron_sched.worker.compiled import CompiledProgram
from vllm_neuron_sched.worker.programs import PROGRAMS, Dimensions, StageShapes

pytestmark = pytest.mark.slow  # two ranks, each importing vLLM (tens of seconds)

HIDDEN = ((6,), torch.float32)  # an intermediate tensor's width and dtype
TOKEN_COUNTS = (8, 16)
ROWS = (1, 2, 4)
STAGE_PROGRAMS = ("share_tokens", "receive_hidden", "send_hidden")
EAGER_BACKEND = {"fullgraph": True, "dynamic": False, "backend": "eager"}


def _rank(rank: int, init_file: str, results: Any) -> None:
    """Rank 0 is the first stage, rank 1 the last."""
    from vllm.distributed.parallel_state import GroupCoordinator

    from vllm_neuron_sched.worker.pipeline import PipelineStage

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    group = GroupCoordinator([[0, 1]], rank, "gloo", False, group_name="pp")
    stage = PipelineStage(group)
    dims = Dimensions(
        rows=ROWS,
        vocab=8,
        history_len=8,
        noise_dtype=torch.float32,
        tokens=TOKEN_COUNTS,
        stage=StageShapes(stage.name, stage.is_first, stage.is_last, (HIDDEN,)),
    )
    torch._dynamo.reset()
    programs: dict[str, CompiledProgram] = {}
    graphs: dict[str, tuple[int, int]] = {}
    with torch.inference_mode():
        # Warm-up in the registry's order, twice, as ``compile_programs``.
        for program in (p for p in PROGRAMS if p.name in STAGE_PROGRAMS):
            examples = list(program.examples(dims))
            counters.clear()
            compiled = CompiledProgram(program, program.sizes(dims), **EAGER_BACKEND)
            for _ in range(2):
                for args in examples:
                    compiled(*args)
            compiled.declared = True
            programs[program.name] = compiled
            graphs[program.name] = (counters["stats"]["unique_graphs"], len(examples))
        # Serving: 3 rows padded to the bucket of 4, hidden states at 16.
        hidden = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)
        tokens = torch.tensor([7, 8, 9], dtype=torch.int32)
        if stage.is_first:
            programs["send_hidden"](hidden, stage.name)
            shared = programs["share_tokens"](
                torch.zeros(3, dtype=torch.int32), stage.name
            )
            received = None
        else:
            received = programs["receive_hidden"](torch.zeros(16, 6), stage.name)
            shared = programs["share_tokens"](tokens, stage.name)
    results.put(
        {
            "rank": rank,
            "graphs": graphs,
            "received": None if received is None else torch.equal(received, hidden),
            "shared": shared.tolist(),
        }
    )
    torch.distributed.destroy_process_group()


def test_stage_transfers_are_one_graph_per_declared_shape_and_arrive_intact() -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ranks = [
            context.Process(target=_rank, args=(rank, init_file, results))
            for rank in (0, 1)
        ]
        for process in ranks:
            process.start()
        answers = {}
        for _ in ranks:
            answer = results.get(timeout=120)
            answers[answer.pop("rank")] = answer
        for process in ranks:
            process.join(timeout=30)
            assert process.exitcode == 0
    first, last = answers[0], answers[1]
    # The first stage sends, the last receives; both share the tokens.
    buckets, counts = len(ROWS), len(TOKEN_COUNTS)
    assert first["graphs"] == {
        "share_tokens": (buckets, buckets),
        "receive_hidden": (0, 0),
        "send_hidden": (counts, counts),
    }
    assert last["graphs"] == {
        "share_tokens": (buckets, buckets),
        "receive_hidden": (counts, counts),
        "send_hidden": (0, 0),
    }
    assert last["received"] is True
    assert first["shared"] == last["shared"] == [7, 8, 9]
