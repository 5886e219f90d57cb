"""Reliability: a soak with async scheduling on, a device fault, bad input.

The soak's oracle is each request run alone in sync mode on the same
checkpoint: batching, reorders, dead tokens and aborts must not change a single
token. A fault inside a device execution must reach the client as an error,
never as wrong tokens, and without a hang. Bad input is refused at the
boundary while the engine keeps serving the requests in flight.
"""

import gc
import random

import pytest

from vllm_neuron_sched.testing.engine_steps import EngineStepper, Req, format_table
from vllm_neuron_sched.testing.oracle import generate_in_subprocess

pytestmark = pytest.mark.slow

EOS = 1
NUM_SOAK_REQUESTS = 200
SOAK_ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 32}


def soak_requests(seed: int = 1234) -> list[Req]:
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_SOAK_REQUESTS):
        max_tokens = rng.randint(1, 24)
        add_at = rng.randint(0, 300)
        ending = rng.random()
        requests.append(
            Req(
                f"s{i}",
                prompt_len=rng.randint(1, 60),
                max_tokens=max_tokens,
                add_at=add_at,
                eos_at=rng.randrange(max_tokens) if ending < 0.3 else None,
                stop=("ka",) if 0.3 <= ending < 0.5 else (),
                abort_at=add_at + rng.randint(0, 20) if ending >= 0.9 else None,
            )
        )
    return requests


def test_soak_async_matches_each_request_alone_in_sync(checkpoint_dir: str) -> None:
    requests = soak_requests()
    soak = EngineStepper(
        checkpoint_dir, async_scheduling=True, eos_token_id=EOS, **SOAK_ENGINE
    )
    try:
        rows, client = soak.run(requests, max_steps=5000)
    finally:
        soak.shutdown()
    table = format_table(rows[-40:])
    assert rows[-1].blocks_used == 0, f"KV blocks leaked\n{table}"
    assert not rows[-1].running and not rows[-1].waiting, table
    assert rows[-1].async_steps > 0, table

    alone = EngineStepper(
        checkpoint_dir, async_scheduling=False, eos_token_id=EOS, **SOAK_ENGINE
    )
    try:
        reference = {}
        for req in requests:
            solo = Req(
                req.req_id, req.prompt_len, req.max_tokens, 0, req.eos_at, req.stop
            )
            _, solo_client = alone.run([solo])
            reference[req.req_id] = solo_client
    finally:
        alone.shutdown()

    for req in requests:
        want = reference[req.req_id]
        got = client.tokens.get(req.req_id, [])
        if req.abort_at is None:
            assert client.finish_reason[req.req_id] == want.finish_reason[req.req_id]
            assert got == want.tokens[req.req_id], req
        else:
            # Aborted: whatever arrived is a prefix of the request's own output.
            assert got == want.tokens[req.req_id][: len(got)], req


def test_fault_in_a_first_chunk_reaches_llm_generate(checkpoint_dir: str) -> None:
    """The second device execution (eager: no warm-up; the first is the
    batch change, the requests joining) is the first 64-token chunk of a
    150-token prompt, which samples nothing: its request returns an error
    and no token, the other request its tokens, and no hang."""
    long, short = [10 + i % 50 for i in range(150)], [10, 11, 12, 13]
    records = generate_in_subprocess(
        checkpoint_dir,
        [long, short],
        {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        {
            "dtype": "float32",
            "max_model_len": 256,
            "max_num_batched_tokens": 64,
            "enforce_eager": True,
        },
        env={"VLLM_NEURON_SCHED_FAULT_AT_EXECUTION": "2"},
        timeout_s=240,
    )
    assert (records[0]["finish_reason"], records[0]["token_ids"]) == ("error", [])
    assert records[1]["finish_reason"] == "length"
    assert len(records[1]["token_ids"]) == 8


@pytest.fixture(scope="module")
def stepper(checkpoint_dir: str, monkeypatch_module) -> EngineStepper:
    monkeypatch_module.setenv("VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT", "200")
    # The front end refuses what no engine alive in this process could run:
    # an earlier module's engine, shut down but not yet collected, would
    # take the request (and finish it with an error) in this one's place.
    gc.collect()
    engine = EngineStepper(checkpoint_dir, async_scheduling=True, eos_token_id=EOS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _bad_inputs(stepper: EngineStepper):
    from vllm import SamplingParams

    add = stepper.engine.add_request
    ok = SamplingParams(max_tokens=4)
    return {
        "empty prompt": lambda: add("bad", {"prompt_token_ids": []}, ok),
        "prompt longer than the model": lambda: add(
            "bad", {"prompt_token_ids": [5] * 300}, ok
        ),
        "max_tokens 0": lambda: SamplingParams(max_tokens=0),
        "max_tokens negative": lambda: SamplingParams(max_tokens=-3),
        "unknown sampling option": lambda: SamplingParams(max_tokens=4, beam=3),
        "logprobs above the limit": lambda: add(
            "bad", {"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=10_000)
        ),
        "over the decode batch tkv limit": lambda: add(
            "bad", {"prompt_token_ids": [5] * 150}, SamplingParams(max_tokens=100)
        ),
    }


def test_bad_input_is_refused_while_others_are_served(stepper: EngineStepper) -> None:
    from vllm.exceptions import VLLMValidationError

    _, alone = stepper.run([Req("good", prompt_len=12, max_tokens=16)])
    errors = {}
    refusals = _bad_inputs(stepper)

    stepper.add(Req("good", prompt_len=12, max_tokens=16))
    tokens: list[int] = []
    for _ in range(3):
        for out in stepper.engine.step():
            tokens.extend(out.outputs[0].token_ids)
    for name, attempt in refusals.items():
        with pytest.raises((ValueError, TypeError, VLLMValidationError)) as info:
            attempt()
        errors[name] = str(info.value)
        for out in stepper.engine.step():
            tokens.extend(out.outputs[0].token_ids)
    for _ in range(100):
        for out in stepper.engine.step():
            tokens.extend(out.outputs[0].token_ids)
        if not stepper.engine.has_unfinished_requests():
            break
    assert tokens == alone.tokens["good"], errors
    assert "tkv limit" in errors["over the decode batch tkv limit"]
    assert "logprobs" in errors["logprobs above the limit"]
    assert all(message for message in errors.values()), errors
