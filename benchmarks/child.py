"""One engine configuration, in its own process: ``python -m benchmarks.child``.

vLLM picks its platform once per process, so stock vLLM and our platform only
compare across processes. The parent (``benchmarks.run``) sends a JSON spec on
stdin, on one line; this prints ``BENCH_PROGRESS`` lines (one per finished unit)
and one ``BENCH_RESULT:`` line with raw per-repeat figures. With
``"interleave": true`` in the spec the child takes turns: before each run
(warm-up, repeat, traced run) it prints ``BENCH_WAIT <workload> <run>`` and
runs only when the parent writes a line to its stdin (``benchmarks.run
--interleave``: the modes' engines all alive, repeat r of each run seconds
apart).

Request timing is taken here, at the front end, as a user sees it: the engine is
driven with ``LLMEngine.add_request`` / ``step()`` and DELTA outputs, each
request's first token is stamped when the ``step()`` that returns it comes
back. This works the same for stock vLLM and ours (``RequestOutput.metrics``
is only filled with ``log_stats`` and mixes front-end and engine-core clocks).
"""

import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

RESULT_MARKER = "BENCH_RESULT:"
PROGRESS_MARKER = "BENCH_PROGRESS"
WAIT_MARKER = "BENCH_WAIT"


@dataclass
class RequestTiming:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None


class RssSampler:
    """Peak RSS of this process and its descendants (EngineCore, workers),
    summed, sampled every ``interval_s`` while running."""

    def __init__(self, interval_s: float = 0.2) -> None:
        import psutil

        self._root = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_mb = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> float:
        import psutil

        total = 0
        for proc in [self._root, *self._root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.sample())
            self._stop.wait(self._interval_s)


@dataclass
class Workload:
    """Requests and when they arrive (seconds after the start)."""

    prompts: list[list[int]]
    params: list[Any]  # SamplingParams per request
    arrivals: list[float]
    meta: dict[str, Any] = field(default_factory=dict)


def _progress() -> None:
    print(PROGRESS_MARKER, flush=True)


class Turns:
    """Runs whenever asked (a child alone) or only on the parent's signal
    (interleaved). A run's key is (workload index, run index: 0 the warm-up,
    1.. the repeats, then the traced run), the same in every mode, so the
    parent lines up the same run of every engine."""

    def __init__(self, interleave: bool) -> None:
        self._interleave = interleave

    def wait(self, workload: int, run: int) -> None:
        if self._interleave:
            print(f"{WAIT_MARKER} {workload} {run}", flush=True)
            if not sys.stdin.readline():  # the parent is gone
                raise SystemExit("benchmark parent closed stdin")


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(length)]  # skip special ids


def make_workload(spec: dict[str, Any], vocab: int) -> Workload:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(spec.get("seed", 0))
    delta = RequestOutputKind.DELTA
    num = spec["num_requests"]

    def greedy(max_tokens: int, stop_ids: list[int] | None = None) -> Any:
        """Never ends on a random EOS: on max_tokens, or on one of stop_ids."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            stop_token_ids=stop_ids,
            output_kind=delta,
        )

    def prompt_len() -> int:
        if spec["kind"] == "batch":
            return spec["prompt_len"]
        return rng.randint(*spec["prompt_len_range"])

    if spec["kind"] in ("batch", "burst"):  # all at once, max_tokens only
        prompts = [_prompt(rng, prompt_len(), vocab) for _ in range(num)]
        params = [greedy(spec["max_tokens"]) for _ in range(num)]
        return Workload(prompts, params, [0.0] * num)
    # "mixed": random prompt lengths and budgets, Poisson arrivals. Half the
    # requests are greedy until one of a few stop tokens, the way a request
    # ends on EOS, so dead tokens show; the other half sample (temperature 1)
    # to max_tokens. Every run and mode thus makes the same number of tokens:
    # a sampled stop ends each run at a different length (3,200-3,900 tokens
    # on the large model), which moved tokens/s more than the modes did.
    # Unseeded: stock vLLM CPU fails on per-request seeds ("CPU Generator
    # does not use offset").
    stop_ids = rng.sample(range(8, vocab), spec.get("num_stop_ids", 16))
    prompts, params, arrivals, now = [], [], [], 0.0
    for i in range(num):
        prompts.append(_prompt(rng, prompt_len(), vocab))
        max_tokens = rng.randint(*spec["max_tokens_range"])
        if i % 2:
            params.append(
                SamplingParams(
                    temperature=1.0,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    output_kind=delta,
                )
            )
        else:
            params.append(greedy(max_tokens, stop_ids))
        arrivals.append(now)
        now += rng.expovariate(spec["arrival_rate"])
    return Workload(prompts, params, arrivals)


def run_workload(llm: Any, workload: Workload, tag: str) -> dict[str, Any]:
    """Drives the engine step by step; front-end timestamps per request."""
    engine = llm.llm_engine
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.arrivals[i])
    timings: dict[str, RequestTiming] = {}
    steps: list[tuple[float, int]] = []  # (stamp, output tokens) per step()
    start = time.perf_counter()
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(order) and workload.arrivals[order[next_index]] <= now:
            i = order[next_index]
            req_id = f"{tag}-{i}"
            timings[req_id] = RequestTiming(arrival=time.perf_counter())
            engine.add_request(
                req_id, {"prompt_token_ids": workload.prompts[i]}, workload.params[i]
            )
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload.arrivals[order[next_index]] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        num_step_tokens = 0
        for output in outputs:
            timing = timings[output.request_id]
            num_new = len(output.outputs[0].token_ids)
            if num_new:
                timing.first_token = timing.first_token or stamp
                timing.last_token = stamp
                timing.num_tokens += num_new
                num_step_tokens += num_new
            if output.finished:
                timing.finish_reason = output.outputs[0].finish_reason
        steps.append((stamp, num_step_tokens))
    elapsed = time.perf_counter() - start
    ttfts = [t.first_token - t.arrival for t in timings.values() if t.first_token]
    tpots = [
        (t.last_token - t.first_token) / (t.num_tokens - 1)
        for t in timings.values()
        if t.first_token and t.last_token and t.num_tokens > 1
    ]
    num_tokens = sum(t.num_tokens for t in timings.values())
    reasons = [t.finish_reason for t in timings.values()]
    return {
        "elapsed_s": elapsed,
        "output_tokens": num_tokens,
        "output_tok_s": num_tokens / elapsed,
        "steady_tok_s": _steady_tok_s(timings, steps),
        "ttft_s": _median(ttfts),
        "ttft_p90_s": _percentile(ttfts, 0.9),
        "tpot_s": _median(tpots),
        "num_finished_stop": reasons.count("stop"),
        "num_finished_length": reasons.count("length"),
    }


def _steady_tok_s(
    timings: dict[str, RequestTiming], steps: list[tuple[float, int]]
) -> float | None:
    """Output tokens/s while every request decodes: from the last request's
    first token to the first request's last one. The same decode batch in
    every mode, whatever each scheduler does to start it."""
    firsts = [t.first_token for t in timings.values() if t.first_token]
    lasts = [t.last_token for t in timings.values() if t.last_token]
    if len(firsts) != len(timings) or not lasts:
        return None
    begin, end = max(firsts), min(lasts)
    tokens = sum(n for stamp, n in steps if begin < stamp <= end)
    return tokens / (end - begin) if end > begin and tokens else None


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _rpc(llm: Any, method: str, *args: Any) -> Any:
    """Rank 0's answer, or None on a worker without the method (stock vLLM)."""
    try:
        return llm.collective_rpc(method, args=args)[0]
    except Exception:
        return None


def _stats_delta(before: dict | None, after: dict | None) -> dict[str, int] | None:
    if not before or not after:
        return None
    return {key: after[key] - before.get(key, 0) for key in after}


def run_config(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine_kwargs"])
    startup_s = time.perf_counter() - t0
    _progress()
    vocab = llm.get_tokenizer().vocab_size
    result: dict[str, Any] = {"startup_s": startup_s, "workloads": {}}
    turns = Turns(spec.get("interleave", False))
    with RssSampler() as rss:
        for index, wl_spec in enumerate(spec["workloads"]):
            name = wl_spec["name"]
            if wl_spec["kind"] == "overlap":
                result["workloads"][name] = run_overlap(llm, wl_spec, vocab)
                continue
            workload = make_workload(wl_spec, vocab)
            if wl_spec.get("warmup", True):  # first-shape compiles, caches
                # A burst meets many step shapes at once: warm them all.
                num_warm = wl_spec["num_requests"] if wl_spec["kind"] == "burst" else 4
                warm = make_workload({**wl_spec, "num_requests": num_warm}, vocab)
                warm.arrivals = [0.0] * len(warm.arrivals)
                turns.wait(index, 0)
                run_workload(llm, warm, f"{name}-warm")
            repeats = []
            for r in range(wl_spec["repeats"]):
                turns.wait(index, 1 + r)
                # Every repeat runs the same prompts: without this, repeats
                # after the first would take their prompts from the cache.
                llm.reset_prefix_cache()
                before = _rpc(llm, "get_async_scheduling_stats")
                figures = run_workload(llm, workload, f"{name}-{r}")
                figures["sched_stats"] = _stats_delta(
                    before, _rpc(llm, "get_async_scheduling_stats")
                )
                repeats.append(figures)
                _progress()
            timeline = None
            if wl_spec.get("trace"):  # one more run, timed: not in the figures
                turns.wait(index, 1 + wl_spec["repeats"])
                llm.reset_prefix_cache()
                _rpc(llm, "set_step_timeline", True)
                run_workload(llm, workload, f"{name}-traced")
                timeline = _rpc(llm, "get_step_timeline")
                _rpc(llm, "set_step_timeline", False)
            result["workloads"][name] = {"repeats": repeats, "timeline": timeline}
    result["peak_rss_mb"] = rss.peak_mb
    return result


def run_overlap(llm: Any, spec: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A fixed decode batch per simulated device latency; per-step figures
    come from the worker's timeline, recorded for this sweep."""
    from benchmarks.analysis import step_figures

    workload = make_workload({**spec, "kind": "batch"}, vocab)
    points: dict[str, Any] = {}
    _rpc(llm, "set_step_timeline", True)
    for sim_ms in spec["sim_ms"]:
        _rpc(llm, "set_sim_device_ms", float(sim_ms))
        run_workload(llm, workload, f"overlap{sim_ms}-warm")
        repeats = []
        for r in range(spec["repeats"]):
            llm.reset_prefix_cache()
            _rpc(llm, "get_step_timeline", True)
            figures = run_workload(llm, workload, f"overlap{sim_ms}-{r}")
            timeline = _rpc(llm, "get_step_timeline")
            figures.update(step_figures(timeline, spec["num_requests"]))
            repeats.append(figures)
            _progress()
        points[str(sim_ms)] = {"repeats": repeats, "timeline": timeline}
    _rpc(llm, "set_sim_device_ms", 0.0)
    _rpc(llm, "set_step_timeline", False)
    return {"points": points}


if __name__ == "__main__":
    spec = json.loads(sys.stdin.readline())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(RESULT_MARKER + json.dumps(run_config(spec)), flush=True)
