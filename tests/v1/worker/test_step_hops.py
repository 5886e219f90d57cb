"""A decode step reads in one pass: each of its two engine calls enters each
module of the package once (docs/design.md section 3), so a change that
sends the step back into a module it left shows here."""

from collections import Counter

import pytest

from vllm_neuron_sched.testing.step_hops import decode_step_visits


def test_each_call_of_a_decode_step_enters_each_module_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "thread")
    visits = decode_step_visits()
    for call, made in visits.items():
        counts = Counter(visit.module for visit in made)
        assert max(counts.values()) == 1, f"{call}: {counts}"
    # The step is started by one call into the step kinds, and sampled by
    # one: the runner never returns to steps.py in between.
    from_runner = {
        call: [v.module for v in made if v.caller == "worker/model_runner.py"]
        for call, made in visits.items()
    }
    assert from_runner == {
        "execute_model": [
            "worker/async_flow.py",
            "worker/kv_cache.py",
            "worker/steps.py",
        ],
        "sample_tokens": [
            "worker/steps.py",
            "worker/host_state.py",
            "worker/async_flow.py",
        ],
    }
