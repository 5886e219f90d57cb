"""Static shapes: the padded sizes a compiled step graph is run at.

A static-shape device compiles one graph per shape, so every step is padded up
to one of a few: decode batches to a batch-size bucket (1, 2, 4, 8, 16, 24, ...:
the grid vLLM captures CUDA graphs at), prefill
steps to a declared prefill shape (a packed row or ``rows x tokens per row``,
core/prefill_shapes.py). A step no shape holds (a scheduler that mixes prefill
and decode) pads its tokens to a token-count bucket up to the step budget.
"""

from dataclasses import dataclass

from vllm_neuron_sched.core.prefill_shapes import (
    PrefillShape,
    default_prefill_shapes,
    fitting_shape,
    powers_of_two_up_to,
)

_MIN_PREFILL_BUCKET = 16


def _default_decode_grid(max_num_seqs: int) -> set[int]:
    """1, 2, 4, then multiples of 8 up to 256 and of 16 beyond: vLLM's own
    CUDA-graph capture grid. A padded row costs as much as a real one (0.7 ms
    a row against 12.5 ms a step on the large benchmark model), so powers of
    two (up to half the batch padding) cost the large model 14% of its decode
    time on the mixed workload (docs/design.md section 8); this grid pads at
    most 7 rows below 256."""
    return {1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs + 1, 16)}


def parse_decode_buckets(spec: str, max_num_seqs: int) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> sorted buckets; empty: ``_default_decode_grid``.

    max_num_seqs is always a bucket, so any decode batch fits one.
    """
    if not spec.strip():
        sizes = _default_decode_grid(max_num_seqs)
    else:
        try:
            sizes = {int(item) for item in spec.split(",") if item.strip()}
        except ValueError:
            raise ValueError(
                f"VLLM_NEURON_SCHED_DECODE_BUCKETS: {spec!r} is not a comma-"
                "separated list of batch sizes (e.g. '1,2,4,8')"
            ) from None
        if any(size <= 0 for size in sizes):
            raise ValueError(
                f"VLLM_NEURON_SCHED_DECODE_BUCKETS: sizes must be > 0: {spec!r}"
            )
    sizes = {size for size in sizes if size < max_num_seqs}
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class Buckets:
    # Decode batch sizes (requests), ascending; the last is max_num_seqs.
    decode: tuple[int, ...]
    # Token counts of steps no prefill shape holds, ascending; the last is
    # max_num_batched_tokens.
    prefill: tuple[int, ...]
    # The declared prefill shapes (VLLM_NEURON_SCHED_PREFILL_SHAPES).
    prefill_shapes: tuple[PrefillShape, ...] = ()

    @classmethod
    def from_limits(
        cls,
        decode_spec: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_shapes: tuple[PrefillShape, ...] | None = None,
    ) -> "Buckets":
        """``prefill_shapes``: the engine's (``engine_prefill_shapes``); by
        default the default grid."""
        start = min(_MIN_PREFILL_BUCKET, max_num_batched_tokens)
        if prefill_shapes is None:
            prefill_shapes = default_prefill_shapes(max_num_batched_tokens)
        return cls(
            decode=parse_decode_buckets(decode_spec, max_num_seqs),
            prefill=powers_of_two_up_to(max_num_batched_tokens, start),
            prefill_shapes=prefill_shapes,
        )

    def pad_decode(self, num_reqs: int) -> int:
        return _smallest_fitting(self.decode, num_reqs)

    def pad_tokens(self, num_tokens: int) -> int:
        return _smallest_fitting(self.prefill, num_tokens)

    def pad_prefill(self, row_tokens: list[int]) -> PrefillShape | int:
        """A prefill step's shape: the smallest declared one holding its
        rows, else its tokens packed to a token-count bucket."""
        shape = fitting_shape(row_tokens, self.prefill_shapes)
        return shape if shape is not None else self.pad_tokens(sum(row_tokens))


def _smallest_fitting(sizes: tuple[int, ...], n: int) -> int:
    for size in sizes:
        if size >= n:
            return size
    # Larger than every bucket (a user scheduler over-filled the step): run it
    # at its own size rather than fail; a real static device would recompile.
    return n
