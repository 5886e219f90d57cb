"""Every VLLM_NEURON_SCHED_* value is checked at start-up: a malformed one is
refused with the variable's name and the accepted form, before any process is
spawned, instead of failing later inside a worker."""

import pytest

from vllm_neuron_sched import envs
from vllm_neuron_sched.core.scheduler import ChunkedPrefillScheduler
from vllm_neuron_sched.testing.scheduler_loop import build_scheduler

# One malformed value per variable, and what the message must say.
BAD_VALUES = {
    "VLLM_NEURON_SCHED_DISABLE": ("maybe", "expected a boolean"),
    "VLLM_NEURON_SCHED_DEVICE": (
        "gpu",
        "expected one of auto, thread, inline, compiled",
    ),
    "VLLM_NEURON_SCHED_SIM_DEVICE_MS": ("fast", "milliseconds, a number >= 0"),
    "VLLM_NEURON_SCHED_MAX_BATCH_TKV_LIMIT": ("-5", "an integer >= 0"),
    "VLLM_NEURON_SCHED_PREFILL_INTERLEAVING": ("sometimes", "expected a boolean"),
    "VLLM_NEURON_SCHED_POOLING_SHAPES": ("64y8", "PROMPT_LENxBATCH"),
    "VLLM_NEURON_SCHED_DECODE_BUCKETS": ("1,two,4", "comma-separated list"),
    "VLLM_NEURON_SCHED_PREFILL_SHAPES": ("2x", "neither pTOKENS nor ROWSxTOKENS"),
    "VLLM_NEURON_SCHED_STATS_INTERVAL_S": ("often", "seconds, a number >= 0"),
    "VLLM_NEURON_SCHED_TIMELINE": ("2", "expected a boolean"),
    "VLLM_NEURON_SCHED_FAULT_AT_EXECUTION": ("1.5", "an integer >= 0"),
}
# Set by the platform for its children, never parsed.
INTERNAL = {"VLLM_NEURON_SCHED_METRICS_DIR"}


def test_every_variable_has_a_bad_value_case() -> None:
    assert set(BAD_VALUES) | INTERNAL == set(envs.environment_variables)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_value_is_refused_at_start_up_with_its_name(
    name: str, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    value, message = BAD_VALUES[name]
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        # Building the configuration runs the platform's start-up check.
        build_scheduler(ChunkedPrefillScheduler, checkpoint_dir, async_scheduling=True)
    assert name in str(error.value)
    assert message in str(error.value)


def test_good_values_parse_to_their_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NEURON_SCHED_PREFILL_INTERLEAVING", "Off")
    monkeypatch.setenv("VLLM_NEURON_SCHED_SIM_DEVICE_MS", " 2.5 ")
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "Thread")
    envs.check_values()
    assert envs.VLLM_NEURON_SCHED_PREFILL_INTERLEAVING is False
    assert envs.VLLM_NEURON_SCHED_SIM_DEVICE_MS == 2.5
    assert envs.VLLM_NEURON_SCHED_DEVICE == "thread"


def test_a_backend_that_does_not_exist_is_refused_at_start_up(
    checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There is no Neuron backend (docs/design.md, section 9, says what one
    must implement): asking for one fails before any process starts."""
    monkeypatch.setenv("VLLM_NEURON_SCHED_DEVICE", "neuron")
    with pytest.raises(
        ValueError, match="expected one of auto, thread, inline, compiled \\["
    ):
        build_scheduler(ChunkedPrefillScheduler, checkpoint_dir, async_scheduling=True)
