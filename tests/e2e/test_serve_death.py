"""One TP rank of the TP=4 async server killed mid-stream.

With async scheduling up to two steps are in flight when a process dies, and
each of our workers runs a device thread. Neither may change what vLLM does
on its own: every request in flight gets an error (an error event in a
stream, a 5xx otherwise), the API server exits within 60 s instead of
hanging, and no engine or worker process outlives it. The engine core's death
is the last test of ``test_serve_tp4.py`` (it ends that module's server); a
node's, of ``test_multi_node.py``.
"""

from collections.abc import Iterator

import pytest

from vllm_neuron_sched.testing.server import (
    OpenAIServer,
    engine_args,
    kill_mid_stream,
    kill_titled,
    thread_binding,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TP = 4
ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "seed": 0,
    "enforce_eager": True,
}


@pytest.fixture(scope="module")
def server(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("death") / "server.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP)}
    args = ["--tensor-parallel-size", str(TP), *engine_args(ENGINE)]
    with OpenAIServer.start(checkpoint_dir, args, log, env, timeout_s=300) as server:
        yield server


async def test_killed_rank_fails_requests_and_server_exits(
    server: OpenAIServer,
) -> None:
    report = await kill_mid_stream(server, kill_titled("VLLM::Worker_TP2"))
    assert all(o.startswith("error") for o in report.outcomes), report
    assert report.outcomes[-1].startswith("error 5"), report  # not streamed
    # vLLM 0.32's API server stops gracefully on a dead engine (exit code 0,
    # the same with stock vLLM); what matters is that it does not hang.
    assert report.exit_s is not None, f"API server hangs\n{server.log_tail()}"
    assert not report.survivors, report
