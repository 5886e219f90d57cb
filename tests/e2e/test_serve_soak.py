"""A server soak with real clients on the async server at TP=1
(``testing/soak.py``: the mix and what must hold after it; the TP=4 server's
soak is in ``test_serve_tp4.py``); then its engine core killed mid-stream.

Last, ``kill -9`` of the engine core mid-stream (a TP rank's death at TP=4
ends ``test_serve_tp4.py``). With async scheduling up to two steps are in
flight when a process dies, and each worker runs a device thread. Neither may
change what vLLM does on its own: every request in flight gets an error (an
error event in a stream, a 5xx otherwise), the API server exits within 60 s
instead of hanging (with exit code 0, vLLM's choice, the same with stock
vLLM), and no engine or worker process outlives it.
"""

from collections.abc import Iterator

import pytest

from vllm_neuron_sched.testing.kills import kill_mid_stream, kill_titled
from vllm_neuron_sched.testing.server import (
    TEST_ENGINE_NICENESS,
    OpenAIServer,
    engine_args,
)
from vllm_neuron_sched.testing.soak import run_soak
from vllm_neuron_sched.testing.workloads import SOAK_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_REQUESTS = 150  # the warm-up runs a tenth more of the same mix


@pytest.fixture(scope="module")
def server(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("soak_tp1") / "server.log"
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /collective_rpc
    args = ["--tensor-parallel-size", "1", *engine_args(SOAK_ENGINE)]
    with OpenAIServer.start(
        checkpoint_dir, args, log, env, 300, TEST_ENGINE_NICENESS
    ) as server:
        yield server


async def test_soak_with_real_clients(server: OpenAIServer) -> None:
    await run_soak(server, NUM_REQUESTS, tp=1)


async def test_killed_engine_core_fails_requests_and_server_exits(
    server: OpenAIServer,
) -> None:
    """Last in the module: it ends the server."""
    report = await kill_mid_stream(server, kill_titled("VLLM::EngineCore"))
    assert all(o.startswith("error") for o in report.outcomes), report
    assert report.outcomes[-1].startswith("error 5"), report  # not streamed
    assert report.exit_s is not None, f"API server hangs\n{server.log_tail()}"
    assert not report.survivors, report
