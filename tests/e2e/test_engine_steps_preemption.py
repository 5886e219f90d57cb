"""Preemption under KV pressure with async scheduling on.

vLLM's AsyncScheduler (``--scheduler-cls``) preempts a running request when
blocks run out, while a step holding it may still be in flight; vLLM has had
bugs there (placeholders going negative, blocks freed under a running step).
Our worker must resume the request and produce the same tokens as without
preemption. Our own scheduler reserves a request's blocks at admission, so
with the same tiny KV cache it never preempts: requests wait instead.
"""

from collections.abc import Iterator

import pytest

from vllm_neuron_sched.testing.engine_steps import EngineStepper, Req, format_table
from vllm_neuron_sched.testing.workloads import MODES

pytestmark = pytest.mark.slow

# Nine 32-token blocks (one is vLLM's null block): each request needs up to
# three (40 + 50 tokens), so three together cannot fit.
ENGINE = {
    "block_size": 32,
    "num_gpu_blocks_override": 9,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
}
REQUESTS = [Req(f"p{i}", prompt_len=40, max_tokens=50, add_at=i) for i in range(3)]


@pytest.fixture(scope="module", params=["vllm_async_scheduler", "ours"])
def stepper(request, checkpoint_dir: str) -> Iterator[EngineStepper]:
    extra = {}
    if request.param == "vllm_async_scheduler":
        extra["scheduler_cls"] = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    engine = EngineStepper(
        checkpoint_dir, async_scheduling=True, eos_token_id=1, **ENGINE, **extra
    )
    yield engine
    engine.shutdown()


def test_preempted_request_resumes_with_same_tokens(stepper: EngineStepper) -> None:
    alone = {}
    for req in REQUESTS:
        _, client = stepper.run([Req(req.req_id, req.prompt_len, req.max_tokens)])
        alone[req.req_id] = client.tokens[req.req_id]

    rows, client = stepper.run(REQUESTS, max_steps=600)
    table = format_table(rows)
    for req in REQUESTS:
        assert client.tokens[req.req_id] == alone[req.req_id], table
        assert client.finish_reason[req.req_id] == "length", table
    assert rows[-1].blocks_used == 0, table
    preempted = {r for row in rows for r in row.preempted}
    ours = type(stepper.scheduler).__module__.startswith("vllm_neuron_sched")
    if ours:
        # Reservation at admission: the third request waits, nothing preempted.
        assert not preempted, table
        assert any(row.waiting == ("p2",) for row in rows), table
    else:
        assert preempted, f"the KV budget should force a preemption\n{table}"


# --- preempted all at once: reset_prefix_cache with requests running --------

ROW = 64  # max_num_batched_tokens: the largest packed prefill row
RESET_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": ROW, "block_size": 32}


@pytest.fixture(scope="module", params=list(MODES))
def reset_stepper(request, checkpoint_dir: str) -> Iterator[EngineStepper]:
    engine = EngineStepper(
        checkpoint_dir,
        eos_token_id=1,
        force_tokens=False,
        **RESET_ENGINE,
        **MODES[request.param],
    )
    yield engine
    engine.shutdown()


def test_reset_prefix_cache_mid_run_keeps_every_token(
    reset_stepper: EngineStepper,
) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` (``LLM``'s, the
    dev endpoint's, ``pause_generation(mode="keep")``'s) preempts every
    running request in vLLM's drop mode: the step in flight for it is
    discarded, and it runs its prompt and the outputs kept again as prompt
    chunks. Reset once where A's re-prefill is one packed step (it samples
    at once, while the discarded step is unread) and once where it ends one
    token past a full row, a rest that shares a step with B's chunk: both
    get the tokens they get without resets."""
    stepper = reset_stepper
    requests = [Req(name, n, 48, ignore_eos=True) for name, n in (("A", 40), ("B", 20))]
    _, alone = stepper.run(requests)

    resets: list[int] = []

    def reset_where_a_resumes_at_a_seam(step: int) -> None:
        a = next(
            (r for r in stepper.scheduler.requests.values() if r.request_id[0] == "A"),
            None,
        )
        in_flight = a is not None and (
            a.num_output_placeholders or stepper.core.batch_queue is None
        )
        if a is None or a.is_prefill_chunk or not in_flight:
            return  # A must be decoding, with a step in flight (async)
        total = a.num_tokens  # prompt + outputs delivered: the re-prefill
        one_step = not resets and ROW - 20 < total <= ROW
        one_past = len(resets) == 1 and total % ROW == 1
        if one_step or one_past:
            resets.append(total)
            stepper.engine.reset_prefix_cache(reset_running_requests=True)

    rows, client = stepper.run(requests, between_steps=reset_where_a_resumes_at_a_seam)
    table = format_table(rows)
    assert len(resets) == 2, f"resets at {resets}\n{table}"
    assert any(row.preempted for row in rows), table
    for req in requests:
        assert client.tokens[req.req_id] == alone.tokens[req.req_id], table
        assert client.finish_reason[req.req_id] == "length", table
