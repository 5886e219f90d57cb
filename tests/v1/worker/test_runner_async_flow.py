"""The async-flow state machine alone: no engine, no tensors."""

import pytest

from vllm_neuron_sched.worker.async_flow import (
    AsyncFlow,
    FlowState,
    PendingStep,
    StepKind,
)

DTYPE = "int32"


class Recorder:
    """Stands in for the runner's materialize callback."""

    def __init__(self) -> None:
        self.materialized: list[PendingStep] = []

    def __call__(self, pending: PendingStep) -> None:
        self.materialized.append(pending)


@pytest.fixture
def flow_and_calls() -> tuple[AsyncFlow, Recorder]:
    calls = Recorder()
    return AsyncFlow(calls), calls


def _pending(req_ids: tuple[str, ...], rows: int = 4, token: str = "f") -> PendingStep:
    return PendingStep(req_ids, token, rows, DTYPE)


def _decode_step(
    flow: AsyncFlow, req_ids: tuple[str, ...], rows: int = 4, placeholders=True
):
    flow.guard(req_ids)
    choice = flow.choose_input_ids(req_ids, StepKind.DECODE, rows, DTYPE, placeholders)
    flow.reinstate(_pending(req_ids, rows, token=f"f{len(req_ids)}"))
    return choice


def test_first_step_uses_host_inputs(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    choice = _decode_step(flow, ("a", "b"), placeholders=False)
    assert not choice.uses_future and not choice.must_rebuild
    assert flow.state is FlowState.SYNC_FALLBACK
    assert calls.materialized == []


def test_steady_state_feeds_the_future_without_host_read(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a", "b"), token="future-N"))
    for step in range(5):
        flow.guard(("a", "b"))
        choice = flow.choose_input_ids(("a", "b"), StepKind.DECODE, 4, DTYPE, True)
        assert choice.tokens == ("future-N" if step == 0 else f"future-{step}")
        assert choice.row_map is None
        flow.reinstate(_pending(("a", "b"), token=f"future-{step + 1}"))
    assert flow.state is FlowState.STEADY_ASYNC
    assert calls.materialized == []
    assert flow.stats() == {
        "async_steps": 5,
        "sync_fallback_steps": 0,
        "prefill_steps": 0,
    }


@pytest.mark.parametrize(
    "new_set",
    [("a",), ("a", "b", "c"), ("a", "c")],
    ids=["finished", "joined", "replaced"],
)
def test_composition_change_costs_exactly_one_fallback(flow_and_calls, new_set) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a", "b")))
    _decode_step(flow, ("a", "b"))
    choice = _decode_step(flow, new_set)
    assert not choice.uses_future
    assert len(calls.materialized) == 1  # the guard broke the flow, once
    for _ in range(3):
        assert _decode_step(flow, new_set).uses_future
    assert flow.async_steps == 4
    assert flow.sync_fallback_steps == 1
    assert len(calls.materialized) == 1


def test_guard_materializes_before_the_state_update(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    pending = _pending(("a", "b"))
    flow.reinstate(pending)
    assert flow.guard(("a",)) is True
    assert calls.materialized == [pending]
    assert flow.guard(("a",)) is True  # same pending, still a different set


def test_shape_mismatch_materializes_and_rebuilds(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a", "b"), rows=2))
    flow.guard(("a", "b"))
    choice = flow.choose_input_ids(("a", "b"), StepKind.DECODE, 4, DTYPE, True)
    assert choice.must_rebuild and not choice.uses_future
    assert len(calls.materialized) == 1
    assert flow.sync_fallback_steps == 1


def test_dtype_mismatch_materializes_and_rebuilds(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a",)))
    flow.guard(("a",))
    choice = flow.choose_input_ids(("a",), StepKind.DECODE, 4, "int64", True)
    assert choice.must_rebuild
    assert len(calls.materialized) == 1


def test_same_set_reorder_remaps_the_future_as_a_fallback(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a", "b", "c"), token="fut"))
    flow.guard(("c", "a", "b"))
    choice = flow.choose_input_ids(("c", "a", "b"), StepKind.DECODE, 4, DTYPE, True)
    assert choice.tokens == "fut"
    assert choice.row_map == (2, 0, 1)
    assert calls.materialized == []  # remapped on device, not read on the host
    assert flow.state is FlowState.SYNC_FALLBACK
    assert flow.stats()["sync_fallback_steps"] == 1


def test_prefill_steps_use_host_inputs_and_are_counted_apart(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.guard(("p",))
    choice = flow.choose_input_ids(("p",), StepKind.PREFILL, 16, DTYPE, False)
    assert not choice.uses_future and not choice.must_rebuild
    flow.reinstate(None)  # a prompt chunk that is not the last samples nothing
    assert flow.pending is None
    assert flow.state is FlowState.HOST_INPUTS
    assert flow.stats() == {
        "async_steps": 0,
        "sync_fallback_steps": 0,
        "prefill_steps": 1,
    }
    assert calls.materialized == []


def test_mixed_step_reading_a_device_token_takes_the_sync_path(flow_and_calls) -> None:
    flow, calls = flow_and_calls
    flow.reinstate(_pending(("a", "p")))
    flow.guard(("a", "p"))  # same set: the guard does not break
    choice = flow.choose_input_ids(("a", "p"), StepKind.MIXED, 16, DTYPE, True)
    assert choice.must_rebuild
    assert len(calls.materialized) == 1
    assert flow.sync_fallback_steps == 1


def test_reinstated_after_every_step_even_a_broken_one(flow_and_calls) -> None:
    flow, _ = flow_and_calls
    flow.reinstate(_pending(("a", "b")))
    _decode_step(flow, ("a",))  # broken
    assert flow.pending is not None and flow.pending.req_ids == ("a",)
    assert _decode_step(flow, ("a",)).uses_future
