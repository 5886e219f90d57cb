"""Engine step tests: the effect of async scheduling, one engine call at a time.

Each case lists its requests and checks the state after every call of the
engine loop (``step()`` sync, ``step_with_batch_queue()`` async): what was
scheduled, what the client received, KV blocks, async counters. On a mismatch
the whole step table is printed. The dead token (docs/design.md section 6) is the
step scheduled past a request's end: async mode computes it when a request
stops on EOS or a stop string, never for max_tokens, and it never reaches the
client.
"""

from collections.abc import Iterator

import pytest

from vllm_neuron_sched.testing.engine_steps import (
    EngineStepper,
    Req,
    Row,
    assert_rows,
    decode_rows,
    format_table,
)
from vllm_neuron_sched.testing.scheduler_loop import interleaving_violations

pytestmark = pytest.mark.slow

EOS = 1  # the checkpoint tokenizer's </s>


@pytest.fixture(scope="module", params=["sync", "async"])
def stepper(request, checkpoint_dir: str) -> Iterator[EngineStepper]:
    engine = EngineStepper(
        checkpoint_dir,
        async_scheduling=request.param == "async",
        eos_token_id=EOS,
        max_num_batched_tokens=32,
        block_size=32,
    )
    yield engine
    engine.shutdown()


def is_async(stepper: EngineStepper) -> bool:
    return stepper.core.batch_queue is not None


def scheduled_positions(rows: list[Row], req_id: str) -> list[int]:
    """Steps whose batch held the request."""
    return [r.step for r in rows if req_id in r.scheduled]


def decode_steps(rows: list[Row], req_id: str) -> int:
    return sum(1 for r in rows if r.scheduled.get(req_id) == 1 and r.kind == "decode")


def check(condition: bool, rows: list[Row], message: str) -> None:
    assert condition, f"{message}\n{format_table(rows)}"


def test_eos_dead_token(stepper: EngineStepper) -> None:
    """EOS at output 4: async schedules one dead decode past it; sync none."""
    rows, client = stepper.run([Req("eos", prompt_len=20, max_tokens=16, eos_at=4)])
    tokens = client.tokens["eos"]
    check(tokens[-1] == EOS and len(tokens) == 5, rows, f"client saw {tokens}")
    check(client.finish_reason["eos"] == "stop", rows, "finish reason")
    dead = 1 if is_async(stepper) else 0
    # Output 0 comes from the prefill; outputs 1-4 from 4 decodes; + dead token.
    check(decode_steps(rows, "eos") == 4 + dead, rows, "decode steps")
    # Its blocks are freed once: nothing used or reserved at the end.
    assert_rows(rows, [{"step": rows[-1].step, "blocks_used": 0, "blocks_reserved": 0}])
    if is_async(stepper):
        # The dead step is scheduled in the call that delivers EOS; its own
        # output (one call later) delivers nothing.
        last = scheduled_positions(rows, "eos")[-1]
        check("eos" in rows[last].finished, rows, "dead step scheduled with EOS")
        check(all("eos" not in r.delivered for r in rows[last + 1 :]), rows, "leak")


def test_max_tokens_never_scheduled_past_end(stepper: EngineStepper) -> None:
    rows, client = stepper.run([Req("len", prompt_len=12, max_tokens=6)])
    check(len(client.tokens["len"]) == 6, rows, "tokens")
    check(client.finish_reason["len"] == "length", rows, "finish reason")
    check(decode_steps(rows, "len") == 5, rows, "no dead token on max_tokens")
    first_decode = next(r.step for r in rows if r.kind == "decode")
    assert_rows(rows, decode_rows(first_decode, first_decode + 4, tkv=13))


def test_dead_token_across_block_boundary(stepper: EngineStepper) -> None:
    """Prompt 30 + EOS at output 2: decodes write positions 30 and 31; the dead
    token's KV goes to position 32, the first slot of a second 32-token block.
    That block is allocated for the dead step and freed with the request."""
    rows, client = stepper.run([Req("edge", prompt_len=30, max_tokens=8, eos_at=2)])
    check(client.tokens["edge"][-1] == EOS, rows, "EOS")
    check(len(client.tokens["edge"]) == 3, rows, "tokens")
    peak = max(r.blocks_at_schedule for r in rows)
    check(peak == (2 if is_async(stepper) else 1), rows, f"peak blocks {peak}")
    check(rows[-1].blocks_used == 0, rows, "blocks freed")


def test_stop_string_across_steps(stepper: EngineStepper) -> None:
    """A stop string made of the end of output 2 and the start of output 3."""
    probe, probe_client = stepper.run([Req("probe", prompt_len=16, max_tokens=8)])
    tokenizer = stepper.engine.get_tokenizer()
    ids = probe_client.tokens["probe"]
    second, third = tokenizer.decode(ids[2:3]), tokenizer.decode(ids[3:4])
    stop = second[-1:] + third[:1]
    text_before = tokenizer.decode(ids[:3])[:-1]
    if stop in text_before or len(stop) < 2:
        pytest.fail(f"probe tokens {ids} give no clean stop string")
    rows, client = stepper.run(
        [Req("probe", prompt_len=16, max_tokens=8, stop=(stop,))]
    )
    check(client.finish_reason["probe"] == "stop", rows, "finish reason")
    check(client.text["probe"] == text_before, rows, f"text {client.text}")
    check(rows[-1].blocks_used == 0, rows, "blocks freed")


def test_abort_while_step_in_flight(stepper: EngineStepper) -> None:
    reqs = [
        Req("keep", prompt_len=10, max_tokens=12),
        Req("drop", prompt_len=10, max_tokens=12, abort_at=5),
    ]
    rows, client = stepper.run(reqs)
    check(len(client.tokens["keep"]) == 12, rows, "other request finished")
    check("drop" not in client.finish_reason, rows, "aborted: no final output")
    check(all("drop" not in r.scheduled for r in rows[6:]), rows, "not scheduled")
    check("drop" not in rows[5].running, rows, "removed at abort")
    check(rows[-1].blocks_used == 0, rows, "blocks freed")


def test_new_request_joins_while_dead_token_in_flight(
    stepper: EngineStepper,
) -> None:
    alone, alone_client = stepper.run([Req("late", prompt_len=14, max_tokens=6)])
    reqs = [
        Req("early", prompt_len=10, max_tokens=20, eos_at=3),
        Req("late", prompt_len=14, max_tokens=6, add_at=5),
    ]
    rows, client = stepper.run(reqs)
    check(client.tokens["late"] == alone_client.tokens["late"], rows, "late tokens")
    check(client.tokens["early"][-1] == EOS, rows, "early stops on EOS")
    check(rows[-1].blocks_used == 0, rows, "blocks freed")


def test_interleaved_prefill_counts(stepper: EngineStepper) -> None:
    """A long prompt's chunks interleave with a running decode; in async mode
    every decode step takes its ids from the token table, across the chunks
    and the join, and none makes the host read ahead of the engine."""
    reqs = [
        Req("dec", prompt_len=8, max_tokens=24),
        Req("long", prompt_len=100, max_tokens=4, add_at=4),
    ]
    rows, client = stepper.run(reqs)
    steps = [{r: row.kind == "prefill" for r in row.scheduled} for row in rows]
    check(interleaving_violations(steps) == [], rows, "interleaving")
    check(len(client.tokens["dec"]) == 24, rows, "decode request")
    if is_async(stepper):
        last = rows[-1]
        num_decodes = sum(1 for r in rows if r.kind == "decode")
        check(last.async_steps == num_decodes, rows, "async decode steps")
        check(last.fallback_steps == 0, rows, "no fallback")


def test_no_token_crosses_requests(stepper: EngineStepper) -> None:
    """Requests of different lengths finishing at different steps (condense
    reorders the batch): each gets exactly the tokens it gets alone."""
    specs = [Req(f"r{i}", prompt_len=6 + 5 * i, max_tokens=4 + 3 * i) for i in range(6)]
    alone = {}
    for spec in specs[:3]:
        _, c = stepper.run([spec])
        alone[spec.req_id] = c.tokens[spec.req_id]
    staggered = [
        Req(s.req_id, s.prompt_len, s.max_tokens, add_at=i) for i, s in enumerate(specs)
    ]
    rows, client = stepper.run(staggered)
    for req_id, tokens in alone.items():
        check(client.tokens[req_id] == tokens, rows, f"{req_id} tokens")
    for spec in specs:
        check(len(client.tokens[spec.req_id]) == spec.max_tokens, rows, spec.req_id)


def test_a_burst_prefills_in_groups(stepper: EngineStepper) -> None:
    """Three requests at once: the first prefill step packs all of them into
    its 32 tokens (the third takes what is left, 3 of its 45 tokens), and
    every request gets exactly the tokens it gets alone."""
    specs = [Req("g0", 20, 6), Req("g1", 9, 6), Req("g2", 45, 6)]
    alone = {s.req_id: stepper.run([s])[1].tokens[s.req_id] for s in specs}
    rows, client = stepper.run(specs)
    first = rows[0].scheduled
    check(rows[0].kind == "prefill", rows, "burst starts with a prefill")
    check(first == {"g0": 20, "g1": 9, "g2": 3}, rows, "one packed 32-token step")
    for req_id, tokens in alone.items():
        check(client.tokens[req_id] == tokens, rows, f"{req_id} tokens")


@pytest.fixture(scope="module", params=["sync", "async"])
def cached_stepper(request, checkpoint_dir: str) -> Iterator[EngineStepper]:
    engine = EngineStepper(
        checkpoint_dir,
        async_scheduling=request.param == "async",
        eos_token_id=EOS,
        max_num_batched_tokens=64,
        block_size=32,
        enable_prefix_caching=True,
    )
    yield engine
    engine.shutdown()


def test_prefix_hits_of_different_lengths_in_one_group(
    cached_stepper: EngineStepper,
) -> None:
    """One prefill step holds requests whose cached prefixes differ (3 blocks,
    1 block, none): each row starts at its own position and pads to the
    step's shape; the tokens equal those computed with an empty cache."""
    base = tuple((11 * i + 3) % 900 + 10 for i in range(120))
    group = [
        Req("long_hit", 0, 6, prompt=base[:100] + (17, 18)),
        Req("short_hit", 0, 6, prompt=base[:40] + (19,)),
        Req("no_hit", 0, 6, prompt=tuple(range(500, 530))),
    ]
    cached_stepper.run([Req("warm", 0, 2, prompt=base[:100])])
    rows, hit = cached_stepper.run(group)
    cached_stepper.engine.reset_prefix_cache()
    fresh_rows, fresh = cached_stepper.run(group)
    table = format_table(rows) + "\n" + format_table(fresh_rows)

    def prompt_tokens(rows: list[Row]) -> int:
        return sum(sum(r.scheduled.values()) for r in rows if r.kind == "prefill")

    # The cached run skips at least long_hit's three cached blocks.
    assert prompt_tokens(rows) <= prompt_tokens(fresh_rows) - 96, table
    check(len(rows[0].scheduled) == 3, rows, "one step for the group")
    for req in group:
        assert hit.tokens[req.req_id] == fresh.tokens[req.req_id], table
