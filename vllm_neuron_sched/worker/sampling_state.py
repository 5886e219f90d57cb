"""What sampling keeps on the device from step to step: the logits
processors (vLLM's built-in ones and the user's) and, where the user's are,
the output histories they read (as lists, vLLM's processor interface; the
sampling programs read the device's token histories instead).

Both belong to the device side and are touched by sampling executions only,
in step order (the ownership rule): a step's sampling first hands the
processors the step's change of the batch (``update_state``, once per step,
as vLLM's runner does), then samples (``apply``), then appends the tokens it
sampled to the histories. So a processor's state carries over from step to
step on every backend, and what it reads as a request's output is the real
tokens of every step before, as stock vLLM's async runner makes sure before
its sampler runs: the host's histories still end in placeholders then, and
the device's never do. Appending reads the sampled tokens back to the host
inside the execution: a port's host step, needed only for the user's
processors (``user_processors``).

The host's input batch holds a recorder in place of the processors: vLLM's
``InputBatch.refresh_metadata`` hands it the step's ``BatchUpdate``, which
the host names by request (``BatchChange``) for the device to apply.
"""

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
)
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor.interface import MovedRequest
    from vllm.v1.sample.metadata import SamplingMetadata

# vLLM's built-in processors: the sampling programs apply what they do from
# the rows' parameters (``logits_rules.py``), and read no history.
BUILTIN_PROCESSORS = (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

# A request that joined the batch: (batch index, its params, its prompt, its
# id, the outputs its device history starts from: [] for a new request, the
# kept outputs for a resumed one, None to go on with the history it has).
AddedRow = tuple[int, "SamplingParams", list[int] | None, str, list[int] | None]


@dataclass(frozen=True)
class BatchChange:
    """One step's change of the input batch, for the device: vLLM's
    ``BatchUpdate`` with each added request named by its id, and the
    requests that finished (their histories go)."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRow]
    moved: Sequence["MovedRequest"]
    finished: Sequence[str]

    @property
    def batch_changed(self) -> bool:
        """False: only requests outside the batch finished (vLLM's input
        batch reports no change as no ``BatchUpdate`` at all)."""
        return bool(self.removed or self.added or self.moved)


class BatchUpdateRecorder(LogitsProcessor):
    """The host batch's only "processor": keeps the last ``BatchUpdate``
    vLLM's input batch handed its processors (``updates``, at most one),
    for the host to take. Its ``update_state`` is the deque's own append,
    so vLLM's call runs no code of this package."""

    def __init__(self) -> None:
        self.updates: deque[BatchUpdate | None] = deque(maxlen=1)
        self.update_state = self.updates.append  # type: ignore[method-assign]

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class SamplingState:
    """Device side: the processors and each live request's output tokens
    (real ones), touched by executions only: ``update`` as a state update
    of the step whose batch changed, the rest inside sampling executions."""

    def __init__(self, processors: LogitsProcessors) -> None:
        self.processors = processors
        self.histories: dict[str, list[int]] = {}
        # A start-up fact: with the user's processors vLLM's sampler samples
        # (their Python acts on the logits) and the lists are kept for them;
        # without, the programs sample (they apply what the built-in ones
        # do), a sampling execution reads nothing back to the host, and the
        # lists stay as they began.
        self.user_processors = not all(
            isinstance(p, BUILTIN_PROCESSORS) for p in processors.all
        )
        # The processors have had this step's update_state already.
        self._updated = False

    def update(self, change: BatchChange) -> None:
        """A state update: the histories of requests that joined or left,
        then each processor's ``update_state``. Its own execution, never a
        sampling one: a sampling that fails (or whose forward did) must not
        take a change of the batch with it."""
        for req_id in change.finished:
            self.histories.pop(req_id, None)
        batch_update = None
        if change.batch_changed:
            batch_update = BatchUpdate(
                batch_size=change.batch_size,
                removed=list(change.removed),
                added=list(self._added(change.added)),
                moved=list(change.moved),
            )
        self._update_processors(batch_update)

    def _added(
        self, added: Sequence[AddedRow]
    ) -> Iterator[tuple[int, "SamplingParams", list[int] | None, list[int]]]:
        for index, params, prompt, req_id, start in added:
            if start is not None or req_id not in self.histories:
                self.histories[req_id] = list(start or ())
            yield index, params, prompt, self.histories[req_id]

    def _update_processors(self, batch_update: BatchUpdate | None) -> None:
        for processor in self.processors.all:
            processor.update_state(batch_update)
        self._updated = True

    def sampling_metadata(
        self,
        metadata: "SamplingMetadata",
        req_ids: Sequence[str],
        needs_histories: bool,
    ) -> "SamplingMetadata":
        """In a sampling execution, before the sampler: each processor has
        had one ``update_state`` since the last sampling (None when the batch
        is as it was, as vLLM calls it every step); the host's metadata with
        the device's processors and, where the sampler reads histories
        (penalties, bad words, the user's processors), the device's."""
        if not self._updated:
            self._update_processors(None)
        self._updated = False
        histories = []
        if needs_histories and self.user_processors:
            histories = [self.histories[req_id] for req_id in req_ids]
        return replace(
            metadata, output_token_ids=histories, logitsprocs=self.processors
        )

    def record(
        self, req_ids: Sequence[str], tokens: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """In a sampling execution, after the sampler: each row's first
        ``counts`` of ``tokens`` [rows, W] are its new outputs (none for a
        row that sampled nothing). Read to the host only where the
        histories are kept (``user_processors``)."""
        if not self.user_processors:
            return
        histories = self.histories
        for req_id, new, count in zip(req_ids, tokens.tolist(), counts.tolist()):
            if count:
                histories[req_id].extend(new[: int(count)])
