"""The device's sampling state: with the user's logits processors, vLLM's
sampler samples and the output histories they read are kept; with vLLM's
built-in ones only, the programs sample (they apply what those do) and a
sampling execution reads nothing back to the host."""

from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_neuron_sched.testing.logits_processors import CountingStopProcessor
from vllm_neuron_sched.testing.sampling import sampling_metadata
from vllm_neuron_sched.worker.sampling_state import BatchChange, SamplingState

CPU = torch.device("cpu")
MAX_NUM_SEQS = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2))


def _state(*processors: object) -> SamplingState:
    """A state whose batch holds requests "a" and "b", new."""
    state = SamplingState(LogitsProcessors(processors))  # type: ignore[arg-type]
    params = SamplingParams(min_tokens=3, logit_bias={1: 2.0})
    added = [(0, params, [9], "a", []), (1, params, [9], "b", [])]
    state.update(BatchChange(2, [], added, [], []))
    return state


def test_the_users_processors_read_each_steps_real_tokens() -> None:
    state = _state(CountingStopProcessor(None, CPU, False))
    assert state.user_processors
    # Step 1: both rows sample; step 2 (a verify step): "a" accepts two
    # tokens, "b" none.
    state.record(["a", "b"], torch.tensor([[5], [6]]), torch.tensor([1, 1]))
    state.record(["a", "b"], torch.tensor([[7, 8], [2, 3]]), torch.tensor([2, 0]))
    metadata = state.sampling_metadata(sampling_metadata([0.0, 0.0]), ["a", "b"], True)
    assert metadata.output_token_ids == [[5, 7, 8], [6]]


def test_without_the_users_processors_nothing_is_read_back() -> None:
    """vLLM's built-in processors read no history here (the programs apply
    them): the sampled tokens stay on the device (a meta tensor has no
    values to read)."""
    cpu = CPU
    state = _state(
        MinTokensLogitsProcessor(None, cpu, False),  # type: ignore[arg-type]
        LogitBiasLogitsProcessor(None, cpu, False),
        MinPLogitsProcessor(MAX_NUM_SEQS, cpu, False),  # type: ignore[arg-type]
    )
    assert not state.user_processors
    on_device = torch.empty(2, 1, dtype=torch.int64, device="meta")
    state.record(["a", "b"], on_device, torch.ones(2, device="meta"))
    metadata = state.sampling_metadata(sampling_metadata([0.0, 0.0]), ["a", "b"], True)
    assert metadata.output_token_ids == []
