"""What a step's sampling costs, vLLM's sampler against our programs.

``python -m benchmarks.sampling_step [--repeats R] [--calls N]``

At the real model's dimensions (SmolLM2's vocabulary, the benchmarks'
``max_model_len`` of 1024, decode buckets 1, 2, 4), greedy rows with 200
prompt and 100 output tokens each: the milliseconds of one step's sampling
by vLLM's ``Sampler`` (what a step with penalties or bad words ran before
they became programs), by our programs eager (the inline and thread
devices) and by our programs compiled per shape with inductor (the compiled
device: ``compile_programs``, whose cold compile time it also prints). Six
cases: plain (greedy); random rows (temperature 0.8, top-p 0.9: the
programs apply a ``min_p`` of 0 too, one graph for rows with and without);
random rows with ``min_p`` 0.05; the three penalties; penalties and two bad
words per row; every rule (those, allowed tokens, ``min_tokens`` and a logit
bias). vLLM's sampler applies ``min_p``, ``min_tokens`` and the logit bias
with its built-in processors.
Medians over ``R`` repeats of ``N`` calls, two torch threads (the device's).
"""

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm_neuron_sched.testing.sampling import sampling_metadata
from vllm_neuron_sched.worker.compiled import compile_programs
from vllm_neuron_sched.worker.logits_rules import QueryPasts, RowRules, plan_rules
from vllm_neuron_sched.worker.programs import EAGER, Dimensions, Programs
from vllm_neuron_sched.worker.sampling import (
    draw_sampling,
    noise_dtype,
    sample_in_program,
)
from vllm_neuron_sched.worker.token_table import history_width

VOCAB = 49152  # SmolLM2's
MAX_MODEL_LEN = 1024  # benchmarks.speculative's engine
PROMPT, OUTPUT = 200, 100
BUCKETS = (1, 2, 4)
# vLLM's per-request bad-words limits (its defaults): the compiled layout.
BAD_WORDS_SHAPE = (128, 1024)
CASES = ("plain", "random", "min_p", "penalties", "bad_words", "every_rule")
RANDOM = ("random", "min_p")


def _params(name: str, words: list[list[int]]) -> SamplingParams:
    """A row's parameters in a case (the bad words tokenized, as the front
    end leaves them)."""
    if name == "every_rule":
        params = SamplingParams(
            max_tokens=OUTPUT + 20,
            min_tokens=OUTPUT + 10,
            stop_token_ids=[2],
            logit_bias={7: 1.5, 8: -2.0},
        )
    elif name == "min_p":
        params = SamplingParams(min_p=0.05)
    else:
        params = SamplingParams()
    params._bad_words_token_ids = words if name in ("bad_words", "every_rule") else []
    return params


def _builtin_processors(params: list[SamplingParams], outputs: list) -> object:
    """vLLM's built-in processors, told of the rows."""
    cpu = torch.device("cpu")
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    processors = [
        MinTokensLogitsProcessor(None, cpu, False),  # type: ignore[arg-type]
        LogitBiasLogitsProcessor(None, cpu, False),
        MinPLogitsProcessor(config, cpu, False),  # type: ignore[arg-type]
    ]
    added = [(row, p, None, outputs[row]) for row, p in enumerate(params)]
    for processor in processors:
        processor.update_state(BatchUpdate(len(params), [], added, []))
    return LogitsProcessors(processors)


def _case(rows: int, name: str, generator: torch.Generator) -> tuple:
    """The metadata vLLM's sampler reads, and the rules (per bad-words
    shape) and the pasts our programs read."""
    metadata = sampling_metadata([0.0] * rows)
    if name in RANDOM:
        metadata = sampling_metadata([0.8] * rows, top_p=[0.9] * rows)
    history = torch.randint(0, VOCAB, (rows, history_width(MAX_MODEL_LEN, 0)))
    outputs = [history[row, PROMPT : PROMPT + OUTPUT].tolist() for row in range(rows)]
    words = {row: [[11, 12], [int(history[row, -1])]] for row in range(rows)}
    if name not in ("plain", *RANDOM):
        metadata = replace(
            metadata,
            no_penalties=False,
            prompt_token_ids=history[:, :PROMPT],
            presence_penalties=torch.full((rows,), 0.2),
            frequency_penalties=torch.full((rows,), 0.2),
            repetition_penalties=torch.full((rows,), 1.1),
            output_token_ids=outputs,
        )
    params = [_params(name, words[row]) for row in range(rows)]
    if name in ("bad_words", "every_rule"):
        metadata = replace(metadata, bad_words_token_ids=words)
    if name in ("every_rule", "min_p"):
        metadata = replace(metadata, logitsprocs=_builtin_processors(params, outputs))
    if name == "every_rule":
        disallowed = torch.zeros(rows, VOCAB, dtype=torch.bool)
        disallowed[:, VOCAB // 2 :] = True
        metadata = replace(metadata, allowed_token_ids_mask=disallowed)
    pasts = QueryPasts(
        history.long(),
        torch.full((rows, 1), PROMPT + OUTPUT),
        torch.full((rows,), PROMPT),
    )
    rules = {
        shape: plan_rules(params, VOCAB, shape) for shape in (None, BAD_WORDS_SHAPE)
    }
    return torch.randn(rows, VOCAB, generator=generator), metadata, rules, pasts


def _vllm(sampler: Sampler, logits: torch.Tensor, metadata: object) -> object:
    return sampler(logits.clone(), metadata)


def _ours(
    sampler: Sampler,
    programs: Programs,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    sampled: np.ndarray,
    rules: RowRules,
    pasts: QueryPasts,
) -> object:
    """The host's draws (at enqueue in an engine), then the programs."""
    draws = draw_sampling(metadata, sampled, VOCAB, noise_dtype(sampler), rules.min_p)
    return sample_in_program(sampler, programs, logits, metadata, draws, rules, pasts)


def _median_ms(call: Callable[[], object], repeats: int, calls: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    compiled = compile_programs(
        Dimensions(
            rows=BUCKETS,
            vocab=VOCAB,
            history_len=history_width(MAX_MODEL_LEN, 0),
            noise_dtype=torch.float32,
            bad_words=BAD_WORDS_SHAPE,
        ),
        {"fullgraph": True, "dynamic": False, "backend": "inductor"},
        lambda fn, *call_args: fn(*call_args),
        "sampling_step",
    )
    print(f"compile_programs (inductor): {time.perf_counter() - start:.1f} s")
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    print("rows  case        vLLM's sampler  programs eager  programs compiled (ms)")
    for rows in BUCKETS:
        for name in CASES:
            logits, metadata, rules, pasts = _case(rows, name, generator)
            sampled = np.ones(rows, dtype=bool)
            calls = [
                partial(_vllm, sampler, logits, metadata),
                partial(
                    _ours, sampler, EAGER, logits, metadata, sampled, rules[None], pasts
                ),
                partial(
                    _ours,
                    sampler,
                    compiled,
                    logits,
                    metadata,
                    sampled,
                    rules[BAD_WORDS_SHAPE],
                    pasts,
                ),
            ]
            with torch.inference_mode():
                times = [_median_ms(call, args.repeats, args.calls) for call in calls]
            print(f"{rows:4}  {name:10}  " + "  ".join(f"{t:14.2f}" for t in times))


if __name__ == "__main__":
    main()
