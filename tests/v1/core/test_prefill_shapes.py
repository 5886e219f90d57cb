"""Static prefill shapes: what the variable accepts, the default grid, and
which shape a prefill step picks."""

import pytest

from vllm_neuron_sched.core.prefill_shapes import (
    PrefillShape,
    default_prefill_shapes,
    fitting_shape,
    parse_prefill_shapes,
    pick_shape,
)

LIMITS = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "max_model_len": 512}


def test_declared_shapes_parse_and_sort_by_size() -> None:
    shapes = parse_prefill_shapes(" 4x32, 1x128 ,2x64,4x32", **LIMITS)
    assert shapes == (PrefillShape(1, 128), PrefillShape(2, 64), PrefillShape(4, 32))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("2x", "is not ROWSxTOKENS"),
        ("axb", "is not ROWSxTOKENS"),
        ("0x16", "must be > 0"),
        ("16x16", "exceed max_num_seqs (8)"),
        ("4x128", "exceed max_num_batched_tokens (256)"),
        ("1x1024", "exceed max_num_batched_tokens (256)"),
    ],
)
def test_a_malformed_or_impossible_shape_names_the_variable(
    spec: str, message: str
) -> None:
    with pytest.raises(ValueError) as error:
        parse_prefill_shapes(spec, **LIMITS)
    assert "VLLM_NEURON_SCHED_PREFILL_SHAPES" in str(error.value)
    assert message in str(error.value)


def test_tokens_per_row_stay_within_max_model_len() -> None:
    with pytest.raises(ValueError, match=r"exceed max_model_len \(64\)"):
        parse_prefill_shapes("1x128", 256, 8, max_model_len=64)


def test_the_default_grid_keeps_the_single_chunk_buckets_and_fills_a_step() -> None:
    shapes = default_prefill_shapes(**LIMITS)
    single = sorted(s.tokens for s in shapes if s.rows == 1)
    assert single == [16, 32, 64, 128, 256]
    assert PrefillShape(8, 32) in shapes and PrefillShape(16, 16) not in shapes
    assert all(s.size <= 256 and s.rows <= 8 for s in shapes)
    # With max_model_len below the budget, no row is longer than a request.
    assert max(s.tokens for s in default_prefill_shapes(256, 8, 100)) == 100


def test_a_lone_request_pads_to_its_own_bucket() -> None:
    shapes = default_prefill_shapes(**LIMITS)
    assert pick_shape([20], shapes) == (PrefillShape(1, 32), 1)
    assert pick_shape([1000], shapes) == (PrefillShape(1, 256), 1)


def test_a_burst_of_short_prompts_shares_one_step() -> None:
    shapes = default_prefill_shapes(**LIMITS)
    shape, count = pick_shape([30] * 8, shapes)
    assert (shape, count) == (PrefillShape(8, 32), 8)


def test_a_long_prompt_is_not_padded_out_by_short_ones() -> None:
    """One 256-token prompt and three short ones: a 4x256 step would be three
    quarters padding; the long one goes alone first."""
    shapes = parse_prefill_shapes("1x256,4x64", 1024, 8, 512)
    assert pick_shape([256, 16, 16, 16], shapes) == (PrefillShape(1, 256), 1)


def test_the_runner_pads_a_step_to_the_smallest_shape_that_holds_it() -> None:
    shapes = parse_prefill_shapes("1x128,2x64,4x32", **LIMITS)
    assert fitting_shape([100], shapes) == PrefillShape(1, 128)
    # 2x64 and 4x32 are the same size: the fewer rows win.
    assert fitting_shape([20, 30], shapes) == PrefillShape(2, 64)
    assert fitting_shape([20, 30, 10], shapes) == PrefillShape(4, 32)
    assert fitting_shape([40, 10], shapes) == PrefillShape(2, 64)
    assert fitting_shape([10] * 5, shapes) is None  # more rows than any shape
