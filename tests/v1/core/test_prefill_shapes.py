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


P = PrefillShape.packed_row


def test_declared_shapes_parse_and_sort_by_size() -> None:
    shapes = parse_prefill_shapes(" 4x32, 1x128 ,2x64,4x32", **LIMITS)
    assert shapes == (PrefillShape(1, 128), PrefillShape(2, 64), PrefillShape(4, 32))
    mixed = parse_prefill_shapes("p256, 2x64,P64", **LIMITS)
    assert mixed == (P(64), PrefillShape(2, 64), P(256))
    assert [str(s) for s in mixed] == ["p64", "2x64", "p256"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("2x", "neither pTOKENS nor ROWSxTOKENS"),
        ("axb", "neither pTOKENS nor ROWSxTOKENS"),
        ("p", "neither pTOKENS nor ROWSxTOKENS"),
        ("p1x16", "neither pTOKENS nor ROWSxTOKENS"),
        ("0x16", "must be > 0"),
        ("p0", "must be > 0"),
        ("p512", "exceed max_num_batched_tokens (256)"),
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


def test_a_packed_row_may_be_longer_than_one_request() -> None:
    assert parse_prefill_shapes("p256", 256, 8, max_model_len=64) == (P(256),)


def test_the_default_grid_is_packed_rows_of_powers_of_two() -> None:
    shapes = default_prefill_shapes(LIMITS["max_num_batched_tokens"])
    assert shapes == (P(16), P(32), P(64), P(128), P(256))
    assert parse_prefill_shapes("", **LIMITS) == shapes
    assert default_prefill_shapes(100)[-1] == P(100)


def test_a_lone_request_pads_to_its_own_bucket() -> None:
    for shapes in (
        default_prefill_shapes(256),
        parse_prefill_shapes("1x16,1x32,1x64,1x128,1x256", **LIMITS),
    ):
        assert pick_shape([20], shapes) == (shapes[1], 1)
        assert pick_shape([1000], shapes) == (shapes[-1], 1)


def test_a_burst_of_short_prompts_shares_one_step() -> None:
    shapes = parse_prefill_shapes("1x32,2x32,4x32,8x32", **LIMITS)
    assert pick_shape([30] * 8, shapes) == (PrefillShape(8, 32), 8)
    # Packed, the step is full: the last of them takes a partial chunk.
    assert pick_shape([30] * 10, default_prefill_shapes(256)) == (P(256), 9)


def test_a_packed_row_fills_up_in_row_order() -> None:
    assert P(64).chunks([40, 40, 40]) == [40, 24]
    assert P(64).chunks([10, 20]) == [10, 20]
    assert PrefillShape(2, 32).chunks([40, 10, 5]) == [32, 10]
    assert P(64).holds([40, 24]) and not P(64).holds([40, 25])


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
    # A packed row holds any number of chunks within its tokens, and wins
    # over a rectangular shape of its size.
    both = parse_prefill_shapes("2x64,p128,p256", **LIMITS)
    assert fitting_shape([10] * 5, both) == P(128)
    assert fitting_shape([20, 30], both) == P(128)
    assert fitting_shape([100, 100], both) == P(256)
