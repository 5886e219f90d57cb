"""Static prefill shapes: ``rows x tokens per row``, and which one a step runs.

A static-shape device compiles one graph per shape. A prefill step of several
requests runs at a shape ``[rows, tokens]``: each request's next chunk is a
row of at most ``tokens`` tokens, padded to it, and rows beyond the group are
padding. ``VLLM_NEURON_SCHED_PREFILL_SHAPES`` declares the shapes
(``"1x128,2x64,4x32"``); ``1xCHUNK`` alone is one request's chunk per step.
Pure policy: no tensors, no threads.
"""

from collections.abc import Sequence
from dataclasses import dataclass

ENV = "VLLM_NEURON_SCHED_PREFILL_SHAPES"
# The default grid: rows and tokens per row are powers of two, tokens from
# this many (or the whole step budget, if smaller) up to the step budget.
_MIN_DEFAULT_TOKENS = 16
# A step's fixed cost (engine core, host, launch), in tokens of compute: a
# shape is scored by real tokens / (padded tokens + this). On the 2-core CPU
# (docs/design.md section 8) a small-model prefill step costs ~5.5 ms plus
# ~0.043 ms per token (~130 tokens of fixed cost); the large model's tokens
# cost ~10x more, so its fixed cost is worth ~15. 64 sits between.
STEP_OVERHEAD_TOKENS = 64


@dataclass(frozen=True, order=True)
class PrefillShape:
    rows: int
    tokens: int  # per row

    @property
    def size(self) -> int:
        """Tokens the device runs, padding included."""
        return self.rows * self.tokens

    def __str__(self) -> str:
        return f"{self.rows}x{self.tokens}"


def parse_prefill_shapes(
    spec: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> tuple[PrefillShape, ...]:
    """``"ROWSxTOKENS,..."``, each shape checked against the configuration;
    empty: the default grid. Sorted by size."""
    if not spec.strip():
        return default_prefill_shapes(
            max_num_batched_tokens, max_num_seqs, max_model_len
        )
    shapes = set()
    for item in spec.split(","):
        try:
            rows, tokens = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(
                f"{ENV}: {item!r} is not ROWSxTOKENS (e.g. '1x128,2x64,4x32')"
            ) from None
        shape = PrefillShape(rows, tokens)
        problem = None
        if rows <= 0 or tokens <= 0:
            problem = "rows and tokens must be > 0"
        elif rows > max_num_seqs:
            problem = f"{rows} rows exceed max_num_seqs ({max_num_seqs})"
        elif shape.size > max_num_batched_tokens:
            problem = (
                f"{shape.size} tokens exceed max_num_batched_tokens "
                f"({max_num_batched_tokens}), the step budget"
            )
        elif tokens > max_model_len:
            problem = f"{tokens} tokens per row exceed max_model_len ({max_model_len})"
        if problem:
            raise ValueError(f"{ENV}: shape {item.strip()!r}: {problem}")
        shapes.add(shape)
    return tuple(sorted(shapes, key=lambda s: (s.size, s.rows)))


def default_prefill_shapes(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> tuple[PrefillShape, ...]:
    """Powers of two: tokens per row from 16 to the step budget (and
    max_model_len), rows from 1 to max_num_seqs, rows x tokens within the
    budget. One request alone gets today's single-chunk buckets (1x16 ...
    1xCHUNK); a burst of short prompts fills a step."""
    max_tokens = min(max_num_batched_tokens, max_model_len)
    shapes = set()
    for tokens in powers_of_two_up_to(max_tokens, min(_MIN_DEFAULT_TOKENS, max_tokens)):
        for rows in powers_of_two_up_to(max_num_seqs, 1):
            if rows * tokens <= max_num_batched_tokens:
                shapes.add(PrefillShape(rows, tokens))
    return tuple(sorted(shapes, key=lambda s: (s.size, s.rows)))


def pick_shape(
    remaining: Sequence[int], shapes: Sequence[PrefillShape]
) -> tuple[PrefillShape, int]:
    """The shape for a prefill step over candidates (prompt tokens left per
    request, in the order they may join) and how many of them it takes, the
    first ones: the most real tokens per unit of cost (padded tokens plus a
    step's fixed cost), then the most real tokens, then the most requests
    (each starts sooner), then the smallest shape."""
    best: tuple[tuple[float, int, int, int], PrefillShape, int] | None = None
    for shape in shapes:
        count = min(shape.rows, len(remaining))
        real = sum(min(left, shape.tokens) for left in remaining[:count])
        cost = shape.size + STEP_OVERHEAD_TOKENS
        score = (real / cost, real, count, -shape.size)
        if best is None or score > best[0]:
            best = (score, shape, count)
    assert best is not None, "no prefill shape"
    return best[1], best[2]


def fitting_shape(
    row_tokens: Sequence[int], shapes: Sequence[PrefillShape]
) -> PrefillShape | None:
    """The smallest shape that holds these rows (tokens per row), or None."""
    longest = max(row_tokens, default=0)
    fits = [s for s in shapes if s.rows >= len(row_tokens) and s.tokens >= longest]
    return min(fits, key=lambda s: (s.size, s.rows), default=None)


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """``start``, doubling while below ``limit``, then ``limit`` itself."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)
