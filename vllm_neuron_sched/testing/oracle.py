"""Run ``LLM.generate`` in a fresh process, for oracle comparisons.

vLLM resolves its platform once per process, so stock vLLM
(``VLLM_NEURON_SCHED_DISABLE=1``) and our platform can only be compared across
processes. A child takes one JSON spec per line and prints one JSON line of
token ids (and logprobs) per spec. Results are kept for the life of the
calling process: the same prompts, sampling, engine and environment give the
same tokens, so test modules that ask for the same oracle start one engine
between them. Children are kept too, one or two per environment: importing
vLLM costs a child about 10 s of a core, its engines seconds each (they run
in the child itself, ``in_process_llm``). A run can be started ahead
(``start_in_subprocess``): a child is mostly one core's work, so it overlaps
the engine or server a test starts meanwhile.
"""

import atexit
import copy
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_neuron_sched.diagnostics import error_lines
from vllm_neuron_sched.metrics import METRICS_DIR_ENV

_MARKER = "NEURON_SCHED_RESULT:"
_runs: dict[str, Future[list[dict[str, Any]]]] = {}
_children = ThreadPoolExecutor(max_workers=2, thread_name_prefix="oracle")
# Idle children kept at most (each holds a vLLM import, about 1 GiB).
_MAX_IDLE_CHILDREN = 4
# Variables set in a process that starts an engine in-process (tests do), by
# vLLM or by our platform (its counters' directory): a child sets its own when
# its engine starts, they do not change its tokens, so the oracle cache must
# not miss on them.
_SET_AT_ENGINE_START = frozenset(
    {
        "VLLM_DIST_IDENT",
        "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
        "VLLM_WORKER_MULTIPROC_METHOD",
        METRICS_DIR_ENV,
    }
)


def generate_in_subprocess(
    model: str,
    prompts: list[str] | list[list[int]],
    sampling: dict[str, Any],
    engine_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Token ids (and logprobs if asked) per prompt, from a fresh engine.

    ``sampling`` holds ``SamplingParams`` keyword arguments, or a list of them
    (one per prompt); ``rounds``: see ``start_in_subprocess``.
    """
    run = start_in_subprocess(
        model, prompts, sampling, engine_kwargs, env, timeout_s, rounds
    )
    return copy.deepcopy(run.result())


def start_in_subprocess(
    model: str,
    prompts: list[str] | list[list[int]],
    sampling: dict[str, Any],
    engine_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    rounds: int = 1,
) -> Future[list[dict[str, Any]]]:
    """``generate_in_subprocess`` without waiting: the run, started now or
    earlier with the same arguments. ``rounds``: the same ``generate`` call
    that many times on one engine (later rounds hit the prefix cache), the
    records of every round in order."""
    spec = {
        "model": model,
        "prompts": prompts,
        "sampling": sampling,
        "engine_kwargs": engine_kwargs or {},
        "rounds": rounds,
    }
    return _start(spec, env, timeout_s)


class _Child:
    """A child process that runs specs one after the other, for one
    environment (vLLM reads it once per process)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reusable = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the child exited

    def run(self, spec: dict[str, Any], timeout_s: float) -> Any:
        """The spec's result; raises with the child's error lines if it
        fails (the child exits then) or takes over ``timeout_s``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        output: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"oracle child took over {timeout_s} s") from None
            if line is None:
                text = "".join(output)
                rc = self.proc.wait()
                raise _child_failed("oracle child", rc, text, "output", text)
            if line.startswith(_MARKER):
                reply = json.loads(line[len(_MARKER) :])
                self.reusable = reply["reusable"]
                return reply["results"]
            output.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_idle: dict[str, list[_Child]] = {}  # environment key -> its idle children
_idle_lock = threading.Lock()


def _run_child(
    spec: dict[str, Any], env: dict[str, str], env_key: str, timeout_s: float
) -> list[dict[str, Any]]:
    """On an idle child of the environment, or a new one; kept afterwards
    unless it failed or cannot start another engine (``_reusable``). Beyond
    ``_MAX_IDLE_CHILDREN`` idle ones, those of the environments first seen
    are closed."""
    with _idle_lock:
        kept = _idle.get(env_key)
        child = kept.pop() if kept else None
    child = child or _Child(env)
    try:
        result = child.run(spec, timeout_s)
    except BaseException:
        child.close()
        raise
    if not child.reusable:
        child.close()  # it exits by itself
        return result
    with _idle_lock:
        _idle.setdefault(env_key, []).append(child)
        idle = [(c, key) for key, cs in _idle.items() for c in cs]
        for old, key in idle[: max(len(idle) - _MAX_IDLE_CHILDREN, 0)]:
            _idle[key].remove(old)
            old.close()
    return result


@atexit.register
def _close_children() -> None:
    with _idle_lock:
        for children in _idle.values():
            for child in children:
                child.close()
        _idle.clear()


def run_json_child(
    argv: list[str],
    spec: Any,
    env: dict[str, str] | None,
    marker: str,
    timeout_s: float,
) -> Any:
    """Runs ``python argv...`` with ``spec`` as JSON on stdin and returns the
    JSON its output prints after ``marker`` (the oracle's children, the
    benchmarks'); a failure raises with the child's error lines."""
    proc = subprocess.run(
        [sys.executable, *argv],
        input=json.dumps(spec) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    output = proc.stdout + proc.stderr
    what = " ".join(argv)
    raise _child_failed(what, proc.returncode, output, "stderr", proc.stderr)


def _child_failed(
    what: str, returncode: int, output: str, tail_name: str, tail: str
) -> RuntimeError:
    """A child's failure: the error lines of its output, then ``tail``'s
    last characters."""
    return RuntimeError(
        f"{what} failed (rc {returncode}):\n"
        + error_lines(output)
        + f"\n--- {tail_name} tail ---\n{tail[-6000:]}"
    )


def start_greedy_tokens(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    engine_kwargs: dict[str, Any],
    env: dict[str, str] | None = None,
) -> Future[list[list[int]]]:
    """Greedy token ids per prompt, ``max_tokens`` each (EOS ignored), from a
    run started now (or earlier)."""
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    run = start_in_subprocess(model, prompts, sampling, engine_kwargs, env)
    tokens: Future[list[list[int]]] = Future()

    def done(records: Future[list[dict[str, Any]]]) -> None:
        try:
            tokens.set_result([r["token_ids"] for r in records.result()])
        except BaseException as error:
            tokens.set_exception(error)

    run.add_done_callback(done)
    return tokens


def generate(llm: Any, prompts: list, sampling: dict | list[dict]) -> list[dict]:
    """``llm.generate`` with keyword-argument sampling params, as JSON records.
    ``structured_outputs`` may be given as the keywords of vLLM's
    ``StructuredOutputsParams``, and ``logit_bias`` keys as strings (JSON, so
    a child process can take them)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams

    def adapter(keywords: dict[str, Any]) -> LoRARequest | None:
        """``"lora": [name, id, path]`` beside the sampling keywords."""
        lora = keywords.get("lora")
        return None if lora is None else LoRARequest(*lora)

    def make(keywords: dict[str, Any]) -> SamplingParams:
        keywords = {k: v for k, v in keywords.items() if k != "lora"}
        structured = keywords.get("structured_outputs")
        if isinstance(structured, dict):
            structured = StructuredOutputsParams(**structured)
            keywords = {**keywords, "structured_outputs": structured}
        if bias := keywords.get("logit_bias"):
            keywords = {**keywords, "logit_bias": {int(t): b for t, b in bias.items()}}
        return SamplingParams(**keywords)

    if isinstance(sampling, list):
        params: Any = [make(s) for s in sampling]
        adapters: Any = [adapter(s) for s in sampling]
    else:
        params, adapters = make(sampling), adapter(sampling)
    if prompts and isinstance(prompts[0], list):
        prompts = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    return [as_record(out) for out in outputs]


def as_record(out: Any) -> dict[str, Any]:
    """A ``RequestOutput``'s first completion: tokens, text, logprobs; and
    every completion's tokens (``n > 1``)."""
    completion = out.outputs[0]

    def steps(logprobs: Any) -> list | None:
        if logprobs is None:
            return None
        return [
            None if step is None else {str(t): lp.logprob for t, lp in step.items()}
            for step in logprobs
        ]

    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "logprobs": steps(completion.logprobs),
        "prompt_logprobs": steps(out.prompt_logprobs),
        "completions": [list(c.token_ids) for c in out.outputs],
    }


def assert_logprobs_close(
    ours: list | None, stock: list | None, tolerance: float
) -> None:
    """Per-step logprob records (``as_record``) with the same tokens and
    values within ``tolerance``."""
    assert (ours is None) == (stock is None)
    if ours is None or stock is None:
        return
    assert len(ours) == len(stock)
    for our_step, stock_step in zip(ours, stock):
        assert (our_step is None) == (stock_step is None)
        if our_step is None:
            continue
        assert our_step.keys() == stock_step.keys()
        for token, logprob in our_step.items():
            assert math.isclose(logprob, stock_step[token], abs_tol=tolerance)


def assert_within_bf16_floor(
    ours: dict[str, Any], stock: dict[str, Any], floor: float
) -> None:
    """One request's record (``as_record``) in bfloat16 against stock's: its
    logits depend on the shapes a batch runs at, which differ from stock's,
    so ours may part from stock's tokens, but only where stock's two most
    likely tokens are within ``2 * floor`` of each other (each may move by
    ``floor``); before that every logprob both report is within ``floor``,
    the prompt logprobs too (``floor``: stock against itself with another
    batch, ``benchmarks/bf16_floor.py``)."""
    tokens, expected = ours["token_ids"], stock["token_ids"]
    part = next((k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if part is None and len(tokens) != len(expected):
        part = min(len(tokens), len(expected))  # one stopped, the other not
    end = len(tokens) if part is None else part
    for name in ("logprobs", "prompt_logprobs"):
        steps = list(zip(ours[name] or [], stock[name] or []))
        for k, (our_step, stock_step) in enumerate(steps):
            if name == "logprobs" and k >= end or our_step is None:
                continue
            for token in our_step.keys() & stock_step.keys():
                ours_lp, stock_lp = our_step[token], stock_step[token]
                if ours_lp != stock_lp:  # (-inf == -inf: a masked token)
                    difference = abs(ours_lp - stock_lp)
                    assert difference <= floor, (name, k, token, difference)
    if part is None:
        assert ours["finish_reason"] == stock["finish_reason"]
        return
    assert stock["logprobs"] is not None and part < len(stock["logprobs"]), (
        f"parted from stock at {part}, where stock has no logprobs to tell why"
    )
    first, second = sorted(stock["logprobs"][part].values(), reverse=True)[:2]
    assert first - second <= 2 * floor, ("parted from stock at", part, first - second)


def spec_decode_counters(llm: Any) -> dict[str, Any]:
    """vLLM's own speculative-decoding counters of an engine (``LLM`` with
    stats on): drafts, draft tokens, accepted tokens, accepted per position."""
    counters: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            counters[name] = getattr(metric, "values", None) or metric.value
    return counters


def counted_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What two readings of ``spec_decode_counters`` counted in between
    (per-position counts position by position)."""

    def minus(value: Any, earlier: Any) -> Any:
        if isinstance(value, list):
            return [v - e for v, e in zip(value, earlier or [0] * len(value))]
        return value - (earlier or 0)

    return {name: minus(value, before.get(name)) for name, value in after.items()}


def start_each_in_subprocess(
    runs: list[dict[str, Any]], env: dict[str, str] | None = None
) -> Future[list[list[dict[str, Any]]]]:
    """Several engines one after the other in one fresh process, each run in
    that process (``in_process``: seconds to start) and shut down before the
    next: the records of each. A run holds ``start_in_subprocess``'s
    ``model``, ``prompts``, ``sampling``, ``engine_kwargs`` and ``rounds``."""
    spec = {"runs": [{"engine_kwargs": {}, "rounds": 1, **run} for run in runs]}
    return _start(spec, env, 900)


def _start(spec: dict[str, Any], env: dict[str, str] | None, timeout_s: float) -> Any:
    """The child for ``spec``, started now or earlier with the same spec and
    environment: vLLM's variables, and those the caller sets (a preloaded
    library, say), which a child keeps for good."""
    full_env = {**os.environ, **(env or {})}
    run_env = {
        k: v
        for k, v in full_env.items()
        if k.startswith("VLLM") and k not in _SET_AT_ENGINE_START
    }
    env_key = json.dumps([sorted(run_env.items()), sorted((env or {}).items())])
    key = json.dumps([spec, env_key], sort_keys=True)
    if key not in _runs:
        _runs[key] = _children.submit(_run_child, spec, full_env, env_key, timeout_s)
    return _runs[key]


def _run(spec: dict[str, Any]) -> Any:
    """Each engine's core runs in the child itself (``in_process_llm``): one
    process per child to start, not two."""
    from vllm_neuron_sched.testing.in_process import in_process_llm

    results = []
    for run in spec.get("runs", [spec]):
        with in_process_llm(run["model"], **run["engine_kwargs"]) as llm:
            results.append(_generate_rounds(llm, run))
    return results if "runs" in spec else results[0]


def embed(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """``llm.embed`` (a pooling model) on token-id prompts, as JSON records."""
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return [{"embedding": list(out.outputs.embedding)} for out in outputs]


def _generate_rounds(llm: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``spec["sampling"]`` None: the model pools (``embed``)."""
    records = []
    for _ in range(spec["rounds"]):
        if spec["sampling"] is None:
            records += embed(llm, spec["prompts"])
            continue
        records += generate(llm, spec["prompts"], spec["sampling"])
    if spec["engine_kwargs"].get("speculative_config"):
        # Engine-wide, the same in every record.
        counters = spec_decode_counters(llm)
        for record in records:
            record["spec_decode"] = counters
    return records


def _reusable() -> bool:
    """Whether this process can start another vLLM engine. Not once numba
    is loaded (vLLM's n-gram proposer loads it): an engine's start scans
    every module for Triton kernels to override (``register_kernels``), and
    llvmlite's library object answers any attribute, ``__dict__`` too, with
    a function wrapper, so the scan fails."""
    return "llvmlite.binding.ffi" not in sys.modules


if __name__ == "__main__":
    # One spec per line until the parent closes stdin, or until this process
    # can start no other engine; a failure exits.
    for spec_line in sys.stdin:
        results = _run(json.loads(spec_line))
        reply = {"results": results, "reusable": _reusable()}
        print(_MARKER + json.dumps(reply), flush=True)
        if not reply["reusable"]:
            break
