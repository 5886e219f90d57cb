"""Static prefill shapes, and which one a step runs.

A static-shape device compiles one graph per shape. Two kinds:

- *packed* ``pT``: one row of ``T`` tokens holding the next chunks of several
  requests back to back, each its own attention sequence (attention is masked
  within the row, as the decode steps' already is), padded at the tail. Only
  the last step of a queue pads: the last request of a full step takes a
  partial chunk. The default.
- *rectangular* ``RxT``: ``R`` rows, each one request's chunk padded to ``T``
  tokens, rows beyond the group padding. For a prefill kernel that takes one
  sequence per row; ``1xCHUNK`` alone is one request per step (the anchors).

``VLLM_NEURON_SCHED_PREFILL_SHAPES`` declares them (``"p128,p512"``,
``"1x128,2x64,4x32"``, or both kinds). Pure policy: no tensors, no threads.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_neuron_sched import envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ENV = "VLLM_NEURON_SCHED_PREFILL_SHAPES"
# The default grid: packed rows of powers of two tokens, from this many (or
# the whole step budget, if smaller) up to the step budget.
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
    # One row holds several requests' chunks back to back (rows is 1).
    packed: bool = False

    @classmethod
    def packed_row(cls, tokens: int) -> "PrefillShape":
        return cls(1, tokens, packed=True)

    @property
    def size(self) -> int:
        """Tokens the device runs, padding included."""
        return self.rows * self.tokens

    @property
    def max_requests(self) -> int:
        """Requests one step at this shape can hold."""
        return self.tokens if self.packed else self.rows

    def chunks(self, remaining: Sequence[int]) -> list[int]:
        """The chunks a step at this shape runs for candidates (prompt
        tokens left per request, in row order): the first ones, each its
        whole rest or what the shape has left for it."""
        if not self.packed:
            return [min(left, self.tokens) for left in remaining[: self.rows]]
        chunks, room = [], self.tokens
        for left in remaining:
            if room == 0:
                break
            chunks.append(min(left, room))
            room -= chunks[-1]
        return chunks

    def holds(self, row_tokens: Sequence[int]) -> bool:
        """Whether a step of these chunks fits this shape."""
        if self.packed:
            return sum(row_tokens) <= self.tokens
        longest = max(row_tokens, default=0)
        return len(row_tokens) <= self.rows and longest <= self.tokens

    def __str__(self) -> str:
        return f"p{self.tokens}" if self.packed else f"{self.rows}x{self.tokens}"


def engine_prefill_shapes(vllm_config: "VllmConfig") -> tuple[PrefillShape, ...]:
    """The engine's prefill shapes (``VLLM_NEURON_SCHED_PREFILL_SHAPES``,
    checked against its configuration): what the start-up check, the
    scheduler and the runner all read. With speculative decoding a row holds
    at least ``1 + K`` tokens: vLLM's scheduler pads a prompt's one-token
    remainder (a prefix-cache hit) to that many, which it never splits."""
    scheduler_config = vllm_config.scheduler_config
    return parse_prefill_shapes(
        envs.VLLM_NEURON_SCHED_PREFILL_SHAPES,
        scheduler_config.max_num_batched_tokens,
        scheduler_config.max_num_seqs,
        vllm_config.model_config.max_model_len,
        min_row_tokens=1 + vllm_config.num_speculative_tokens,
    )


def parse_prefill_shapes(
    spec: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    min_row_tokens: int = 1,
) -> tuple[PrefillShape, ...]:
    """``"pTOKENS"`` (packed) and ``"ROWSxTOKENS"`` items, comma-separated,
    each checked against the configuration (``min_row_tokens``: the fewest
    tokens a row may hold); empty: the default grid. Sorted by size."""
    if not spec.strip():
        return default_prefill_shapes(max_num_batched_tokens, min_row_tokens)
    shapes = set()
    for item in spec.split(","):
        text = item.strip().lower()
        try:
            if text.startswith("p"):
                shape = PrefillShape.packed_row(int(text[1:]))
            else:
                rows, tokens = (int(x) for x in text.split("x"))
                shape = PrefillShape(rows, tokens)
        except ValueError:
            raise ValueError(
                f"{ENV}: {item!r} is neither pTOKENS nor ROWSxTOKENS "
                "(e.g. 'p128,p512' or '1x128,2x64,4x32')"
            ) from None
        rows, tokens = shape.rows, shape.tokens
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
        elif tokens > max_model_len and not shape.packed:
            problem = f"{tokens} tokens per row exceed max_model_len ({max_model_len})"
        elif tokens < min_row_tokens:
            problem = (
                f"{tokens} tokens per row are fewer than 1 + num_speculative_tokens "
                f"({min_row_tokens}): vLLM pads a prompt's one-token remainder to "
                "that many when it speculates"
            )
        if problem:
            raise ValueError(f"{ENV}: shape {item.strip()!r}: {problem}")
        shapes.add(shape)
    return tuple(sorted(shapes, key=_by_size))


def default_prefill_shapes(
    max_num_batched_tokens: int, min_row_tokens: int = 1
) -> tuple[PrefillShape, ...]:
    """Packed rows of 16, 32, 64, ... tokens up to the step budget (from the
    first power of two that holds ``min_row_tokens``): a burst fills whole
    steps (no padding), a lone request pads to its power of two, and the
    device compiles one graph per doubling. The rectangular grid (every
    power-of-two ``RxT`` within the budget, dozens of graphs) padded 10% more
    tokens on the large model's mixed workload (docs/design.md section 8)."""
    start = _MIN_DEFAULT_TOKENS
    while start < min_row_tokens:
        start *= 2
    start = min(start, max_num_batched_tokens)
    return tuple(
        PrefillShape.packed_row(tokens)
        for tokens in powers_of_two_up_to(max_num_batched_tokens, start)
    )


def _by_size(shape: PrefillShape) -> tuple[int, int, bool]:
    """Smaller first; at equal size fewer rows, then packed (it holds more)."""
    return shape.size, shape.rows, not shape.packed


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
        chunks = shape.chunks(remaining)
        count, real = len(chunks), sum(chunks)
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
    return min((s for s in shapes if s.holds(row_tokens)), key=_by_size, default=None)


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """``start``, doubling while below ``limit``, then ``limit`` itself."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)
