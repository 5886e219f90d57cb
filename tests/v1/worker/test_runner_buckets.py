"""Static-shape buckets: decode batch sizes and prefill token counts."""

import pytest

from vllm_neuron_sched.worker.buckets import Buckets, parse_decode_buckets


def test_default_decode_buckets_are_vllms_cuda_graph_grid_up_to_max_num_seqs() -> None:
    assert parse_decode_buckets("", 8) == (1, 2, 4, 8)
    assert parse_decode_buckets("", 6) == (1, 2, 4, 6)
    # vLLM's CUDA-graph grid: multiples of 8 past 8, never more than 7 rows
    # of padding below 256.
    assert parse_decode_buckets("", 64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert parse_decode_buckets("", 20) == (1, 2, 4, 8, 16, 20)


def test_user_decode_buckets_always_end_at_max_num_seqs() -> None:
    assert parse_decode_buckets("4, 1,16", 8) == (1, 4, 8)


@pytest.mark.parametrize("spec", ["1,x", "0,2"])
def test_bad_decode_buckets_say_what_is_wrong(spec: str) -> None:
    with pytest.raises(ValueError, match="VLLM_NEURON_SCHED_DECODE_BUCKETS"):
        parse_decode_buckets(spec, 8)


def test_padding_picks_the_smallest_fitting_bucket() -> None:
    buckets = Buckets.from_limits("", max_num_seqs=8, max_num_batched_tokens=48)
    assert buckets.prefill == (16, 32, 48)
    assert [buckets.pad_decode(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    assert [buckets.pad_tokens(n) for n in (1, 16, 17, 48)] == [16, 16, 32, 48]
    assert buckets.pad_tokens(60) == 60  # over-full step: run as is
