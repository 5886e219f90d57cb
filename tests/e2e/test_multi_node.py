"""Two nodes on loopback: pipeline parallel across them, TP inside each
(PP=2 x TP=2) over vLLM's multiprocessing executor, async on.

Node 0 is the API server with the first stage (TP ranks 0-1); node 1 runs
``serve --headless`` with the second, which samples and holds the output
rank. Both bind their two workers to the two cores (``0|1``), the way two
TP=2 halves would on two machines. Greedy completions, streamed and not,
must equal our platform at TP=1; the per-rank state RPC must reach all four
ranks, with equal token histories and at most two steps in flight. Last,
node 1 dies (every process on it): the API server must report an error to the
requests in flight and exit, not hang. The first stage's ranks fail their
transfer and exit; the engine, waiting for the output rank's reply from node
1, gives up after vLLM's execute-model timeout, set to 20 s (vLLM's default:
300).
"""

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from vllm_neuron_sched.binding import thread_binding
from vllm_neuron_sched.testing.kills import kill_mid_stream
from vllm_neuron_sched.testing.oracle import start_greedy_tokens
from vllm_neuron_sched.testing.server import (
    TEST_ENGINE_NICENESS,
    HeadlessNode,
    OpenAIServer,
    engine_args,
    free_port,
    greedy_completion,
    lower_priority,
)
from vllm_neuron_sched.testing.workloads import (
    SERVER_ENGINE,
    SERVER_MAX_TOKENS,
    server_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TP = 2  # per stage, inside a node
PP = 2  # stages, one per node
NODES = 2
ENGINE = SERVER_ENGINE
MAX_TOKENS = SERVER_MAX_TOKENS
COLLECTIVE_TIMEOUT_S = 60
# A step of this model takes milliseconds, also on two busy cores.
EXECUTE_MODEL_TIMEOUT_S = 20
PROMPTS = server_prompts()


@pytest.fixture(scope="module")
def nodes(
    checkpoint_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OpenAIServer, HeadlessNode]]:
    logs: Path = tmp_path_factory.mktemp("two_nodes")
    args = [
        "--tensor-parallel-size", str(TP),
        "--pipeline-parallel-size", str(PP),
        # vLLM's default with pipeline stages is sync.
        "--async-scheduling",
        "--nnodes", str(NODES),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        # Bounds how long the survivors of a dead node wait in a collective
        # (gloo's default: 30 minutes).
        "--distributed-timeout-seconds", str(COLLECTIVE_TIMEOUT_S),
        "--cpu-distributed-timeout-seconds", str(COLLECTIVE_TIMEOUT_S),
        *engine_args(ENGINE),
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(TP * PP // NODES),
        "VLLM_SERVER_DEV_MODE": "1",  # POST /collective_rpc
        # The output rank (the last stage's) is on node 1: when it dies, the
        # engine on node 0 waits for its reply this long (vLLM's default: 300).
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_MODEL_TIMEOUT_S),
    }
    with HeadlessNode(
        checkpoint_dir, [*args, "--node-rank", "1"], logs / "node1.log", env
    ) as node1:
        try:
            server = OpenAIServer.start(
                checkpoint_dir,
                [*args, "--node-rank", "0"],
                logs / "node0.log",
                env,
                timeout_s=300,
                engine_niceness=TEST_ENGINE_NICENESS,
            )
            lower_priority(node1.processes(), TEST_ENGINE_NICENESS)
        except BaseException as error:
            tail = node1.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"node 0 did not start; node 1 log:\n{tail}") from error
        with server:
            yield server, node1


@pytest.fixture(scope="module")
def tp1_tokens(tp1_run: Future[list[list[int]]]) -> list[list[int]]:
    return tp1_run.result()


@pytest.fixture(scope="module", autouse=True)
def tp1_run(checkpoint_dir: str) -> Future[list[list[int]]]:
    """Started with the module: the TP=1 child runs while the nodes start."""
    engine = {**ENGINE, "max_num_seqs": 4}
    return start_greedy_tokens(checkpoint_dir, PROMPTS, MAX_TOKENS, engine)


async def test_two_nodes_equal_tp1_and_ranks_agree(
    nodes: tuple[OpenAIServer, HeadlessNode], tp1_tokens: list[list[int]]
) -> None:
    server, _ = nodes
    client = server.client()
    before = await server.ametrics()
    *results, mid_run = await asyncio.gather(
        *(greedy_completion(client, p, stream=False) for p in PROMPTS),
        *(greedy_completion(client, p, stream=True) for p in PROMPTS),
        server.rank_states(),
    )
    assert results[: len(PROMPTS)] == tp1_tokens
    assert results[len(PROMPTS) :] == tp1_tokens

    after = await server.wait_idle()
    final = await server.rank_states()
    for states in (mid_run, final):
        assert sorted(s["tp_rank"] for s in states) == sorted(list(range(TP)) * PP)
        assert len({s["history_digest"] for s in states}) == 1, states
        assert len({s["finished_digest"] for s in states}) == 1, states
        assert all(s["max_in_flight_steps"] <= 2 for s in states), states
    assert all(s["num_requests"] == 0 for s in final), final
    async_steps = "vllm:neuron_sched_async_steps_total"
    assert after[async_steps] > before.get(async_steps, 0)
    assert after["vllm:kv_cache_usage_perc"] == 0


async def test_dead_node_fails_requests_and_server_exits(
    nodes: tuple[OpenAIServer, HeadlessNode],
) -> None:
    """Last in the module: it ends both nodes."""
    server, node1 = nodes
    report = await kill_mid_stream(
        server, lambda _: node1.kill(), timeout_s=EXECUTE_MODEL_TIMEOUT_S + 60
    )
    assert all(o.startswith("error") for o in report.outcomes), report
    assert report.exit_s is not None, f"API server hangs\n{server.log_tail()}"
    assert not report.survivors, report
