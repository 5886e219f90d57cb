"""A device failure reaches the client as an error, never as wrong tokens,
and the engine serves the others: on the default (inline) device and on a
device thread, sync and async, through vLLM's engine one call at a time.

The fault hits the forward of a long prompt's first chunk, a step that
samples nothing (whose failure used to go unread), then a decode step's
sampling. The prefix cache is on, so a following request with the same
prompt would hit the chunk's blocks, never written, if they stayed cached.
"""

from collections.abc import Iterator

import pytest

from vllm_neuron_sched.testing.engine_steps import EngineStepper, Req, format_table

pytestmark = pytest.mark.slow

EOS = 1
CONFIGS = [
    ("inline", "sync"),
    ("inline", "async"),
    ("thread", "sync"),
    ("thread", "async"),
]


@pytest.fixture(scope="module", params=CONFIGS, ids=["-".join(c) for c in CONFIGS])
def stepper(request, checkpoint_dir: str) -> Iterator[EngineStepper]:
    device, mode = request.param
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_NEURON_SCHED_DEVICE", device)
        engine = EngineStepper(
            checkpoint_dir,
            async_scheduling=mode == "async",
            eos_token_id=EOS,
            max_num_batched_tokens=32,
            block_size=32,
            enable_prefix_caching=True,
        )
    yield engine
    engine.shutdown()


def test_fault_in_a_chunk_that_samples_nothing(stepper: EngineStepper) -> None:
    keep = Req("keep", prompt_len=10, max_tokens=16)
    long = Req("long", prompt_len=150, max_tokens=8, add_at=3)
    _, keep_alone = stepper.run([Req("keep", prompt_len=10, max_tokens=16)])

    # Step 3: the batch change (keep leaves, long joins), then the forward.
    rows, client = stepper.run(
        [keep, long], before_step={3: lambda: stepper.inject_device_fault(2)}
    )
    table = format_table(rows)
    assert rows[3].scheduled == {"long": 32}, table  # the faulted step
    assert client.finish_reason["long"] == "error", table
    assert client.tokens.get("long", []) == [], table
    assert client.tokens["keep"] == keep_alone.tokens["keep"], table
    assert rows[-1].blocks_used == 0, table

    # The same prompt again: computed anew (not from never-written blocks)...
    _, again = stepper.run([Req("long", prompt_len=150, max_tokens=8)])
    stepper.engine.reset_prefix_cache()
    # ... equals it computed from an empty prefix cache.
    _, fresh = stepper.run([Req("long", prompt_len=150, max_tokens=8)])
    assert again.finish_reason["long"] == "length"
    assert again.tokens["long"] == fresh.tokens["long"]


def test_fault_in_a_decode_steps_sampling(stepper: EngineStepper) -> None:
    """Both decoding requests fail at the same step, each after a prefix of
    its own tokens; the next request is served."""
    pair = [Req(f"p{i}", prompt_len=12, max_tokens=24) for i in range(2)]
    alone = {r.req_id: stepper.run([r])[1].tokens[r.req_id] for r in pair}
    rows, client = stepper.run(
        pair, before_step={8: lambda: stepper.inject_device_fault(2)}
    )
    table = format_table(rows)
    assert rows[8].kind == "decode" and set(rows[8].scheduled) == {"p0", "p1"}, table
    for req in pair:
        got = client.tokens[req.req_id]
        assert client.finish_reason[req.req_id] == "error", table
        assert 0 < len(got) < 24 and got == alone[req.req_id][: len(got)], table
    assert rows[-1].blocks_used == 0, table
    _, after = stepper.run([pair[0]])
    assert after.tokens["p0"] == alone["p0"]
