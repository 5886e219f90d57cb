"""A server soak with real clients (``run_soak``).

The ``openai`` async client sends a seeded mix, ``CONCURRENCY`` at a time:
streaming and not, random prompt lengths and ``max_tokens``, stop strings,
logprobs, a JSON schema; a tenth of the clients disconnect mid-stream and a
twentieth send a request that must get a 400. Afterwards every completed
request must equal its solo run on the same server (greedy), the server must
hold nothing (``/metrics``, every rank's host state by RPC), its memory must
be back where it was after warm-up, and the dead tokens stay within one per
request that ended early.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from vllm_neuron_sched.testing.server import SERVED_MODEL, OpenAIServer

CONCURRENCY = 16
STOP_STRINGS = ["ka", "zu"]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 1000}, "max_model_len"),
    ({"logprobs": 50}, "greater than max allowed"),
    ({"prompt": list(range(10, 310))}, "maximum context length"),
]
RSS_TOLERANCE = 0.05


@dataclass
class Spec:
    """One client's request and what it does with the response."""

    index: int
    params: dict[str, Any]
    stream: bool
    disconnect_after: int | None = None  # chunks read before closing
    bad: str | None = None  # the expected error message, for a 400


@dataclass
class Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[str, float]] = field(default_factory=list)
    status: str = "completed"  # completed | disconnected | rejected


def soak_specs(num: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(num):
        params: dict[str, Any] = {
            "model": SERVED_MODEL,
            "prompt": [rng.randrange(10, 500) for _ in range(rng.randint(4, 60))],
            "max_tokens": rng.randint(4, 32),
            "temperature": 0.0,
        }
        extra: dict[str, Any] = {"return_token_ids": True}
        roll = rng.random()
        if roll < 0.05:
            kwargs, message = rng.choice(BAD_REQUESTS)
            specs.append(Spec(i, {**params, **kwargs}, stream=False, bad=message))
            continue
        if roll < 0.15:
            params["max_tokens"] = 200
            extra["ignore_eos"] = True
            specs.append(
                Spec(
                    i,
                    {**params, "extra_body": extra},
                    stream=True,
                    disconnect_after=rng.randint(1, 3),
                )
            )
            continue
        if rng.random() < 0.25:
            params["stop"] = [rng.choice(STOP_STRINGS)]
        if rng.random() < 0.2:
            params["logprobs"] = 2
        if rng.random() < 0.1:
            extra["structured_outputs"] = {"json": JSON_SCHEMA}
        params["extra_body"] = extra
        specs.append(Spec(i, params, stream=rng.random() < 0.5))
    return specs


async def run_one(client: openai.AsyncOpenAI, spec: Spec) -> Outcome:
    if spec.bad is not None:
        try:
            await client.completions.create(**spec.params)
        except openai.BadRequestError as error:
            assert error.status_code == 400
            assert spec.bad in str(error), str(error)
            return Outcome(status="rejected")
        raise AssertionError(f"request {spec.index} was not refused: {spec.params}")
    outcome = Outcome()
    if not spec.stream:
        choice = (await client.completions.create(**spec.params)).choices[0]
        outcome.text = choice.text
        outcome.token_ids = list(choice.token_ids or [])
        outcome.finish_reason = choice.finish_reason
        if choice.logprobs is not None:
            outcome.logprobs = list(choice.logprobs.top_logprobs or [])
        return outcome
    stream = await client.completions.create(stream=True, **spec.params)
    num_chunks = 0
    async for chunk in stream:
        num_chunks += 1
        choice = chunk.choices[0]
        outcome.text += choice.text
        outcome.token_ids += choice.token_ids or []
        outcome.finish_reason = choice.finish_reason or outcome.finish_reason
        if choice.logprobs is not None:
            outcome.logprobs += choice.logprobs.top_logprobs or []
        if spec.disconnect_after is not None and num_chunks >= spec.disconnect_after:
            await stream.close()  # an unread body: the connection is closed
            outcome.status = "disconnected"
            break
    return outcome


async def run_all(
    client: openai.AsyncOpenAI, specs: list[Spec], concurrency: int
) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(spec: Spec) -> Outcome:
        async with gate:
            return await run_one(client, spec)

    return await asyncio.gather(*(gated(spec) for spec in specs))


def same_logprobs(a: list[dict[str, float]], b: list[dict[str, float]]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        if any(abs(x[k] - y[k]) > 1e-3 for k in x):
            return False
    return True


async def run_soak(
    server: OpenAIServer, num: int, tp: int, seed: int = 1234
) -> dict[str, Any]:
    """Warm-up, then ``num`` requests of the mix (``seed``'s), at most
    ``CONCURRENCY`` at a time; raises AssertionError where the server did
    not hold (the module docstring), else returns the report. The server needs
    ``VLLM_SERVER_DEV_MODE=1`` (the per-rank state by RPC)."""
    client = server.client(timeout_s=300)
    # Warm-up on the same mix: grammars compiled, allocators at their size.
    await run_all(client, soak_specs(num // 10, seed=7), CONCURRENCY)
    await server.wait_idle()
    rss_warm = server.rss_bytes()
    before = await server.ametrics()

    specs = soak_specs(num, seed)
    start = time.monotonic()
    outcomes = await run_all(client, specs, CONCURRENCY)
    duration = time.monotonic() - start

    after = await server.wait_idle()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    states = await server.rank_states()
    assert sorted(s["tp_rank"] for s in states) == list(range(tp))
    assert all(s["num_requests"] == 0 for s in states), states
    # At most its last step, whose results are in: an idle worker applies it
    # in the next thing it runs, and whether the engine sends an empty step
    # after the last output is the engine's timing (one step held was seen
    # once, on a starved machine).
    assert all(s["in_flight_steps"] <= 1 for s in states), states
    assert len({s["history_digest"] for s in states}) == 1, states
    rss_after = server.rss_bytes()

    counts = {
        status: sum(o.status == status for o in outcomes)
        for status in ("completed", "disconnected", "rejected")
    }
    ended_early = sum(
        o.status == "completed" and o.finish_reason == "stop" for o in outcomes
    )
    dead = (
        after["vllm:neuron_sched_dead_tokens_total"]
        - before["vllm:neuron_sched_dead_tokens_total"]
    )
    report = {
        "tp": tp,
        "requests": num,
        "duration_s": round(duration, 1),
        **counts,
        "stop_ended": ended_early,
        "dead_tokens": dead,
        "rss_warm_mb": rss_warm >> 20,
        "rss_after_mb": rss_after >> 20,
    }
    print("soak:", json.dumps(report))
    assert counts["disconnected"] >= num // 20, report
    assert counts["rejected"] >= 1, report
    assert ended_early >= 1, report
    # One dead token at most per request that ended before its max_tokens:
    # on a stop (token or string) or by its client going away.
    assert dead <= ended_early + counts["disconnected"], report
    assert abs(rss_after - rss_warm) <= RSS_TOLERANCE * rss_warm, report

    # Each completed request, alone on the same server: the same tokens.
    mismatches = []
    for spec, outcome in zip(specs, outcomes, strict=True):
        if outcome.status != "completed":
            continue
        solo = await run_one(client, spec)
        if (solo.token_ids, solo.text, solo.finish_reason) != (
            outcome.token_ids,
            outcome.text,
            outcome.finish_reason,
        ) or not same_logprobs(solo.logprobs, outcome.logprobs):
            mismatches.append((spec.index, spec.params, outcome, solo))
    assert not mismatches, mismatches[:3]
    return report
