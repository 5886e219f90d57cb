"""The worker's host request state, with one owner: the main thread.

vLLM's ``CachedRequestState`` per request and its persistent ``InputBatch``,
updated from each ``SchedulerOutput``; the token slots of the device token
table; the placeholders a sampled token leaves in a history until its step
retires; the prompt-logprob buffers. Nothing else writes any of it: the
device thread runs only what the main thread enqueues, and the executor's
output thread only reads device results.
"""

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.utils.math_utils import cdiv
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_neuron_sched.worker.sampling_state import BatchChange, BatchUpdateRecorder
from vllm_neuron_sched.worker.token_table import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

# req_id -> (the request's output_token_ids, index of its first placeholder,
# how many); the list itself is held, so a finished request's history is
# completed too.
Placeholders = dict[str, tuple[list[int], int, int]]
# Steps that retired, oldest first: what each left, and its output.
Retired = Sequence[tuple[Placeholders, "ModelRunnerOutput"]]
# A prompt chunk's logprobs job for the forward (prompt_logprobs_on_device):
# (batch row, chunk start, target ids, logprobs wanted, the request's buffer).
PromptLogprobsJob = tuple[int, int, torch.Tensor, int, LogprobsTensors]


class TokenSlots:
    """Which entry of the device token table each request in the batch
    owns: from the step it joins (new, or resumed after a preemption) until
    it finishes or is preempted. vLLM's scheduler runs at most
    ``max_num_seqs`` requests, so the table has a fixed size: a static-shape
    device's programs read and write it at one shape."""

    def __init__(self, capacity: int) -> None:
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(capacity, 0, -1))  # 0: the spare
        self._capacity = capacity

    def assign(self, req_id: str) -> None:
        if req_id in self._slot_of:
            return
        if not self._free:
            raise RuntimeError(
                f"more than {self._capacity} requests hold a token slot: the "
                "scheduler ran more than max_num_seqs, or did not report a "
                "preempted request (SchedulerOutput.preempted_req_ids)"
            )
        self._slot_of[req_id] = self._free.pop()

    def release(self, req_id: str) -> None:
        """The request left (finished or preempted): its slot is free for the
        next one (an enqueued step may still write it; the new owner's
        writes and reads come after, in device order)."""
        if (slot := self._slot_of.pop(req_id, None)) is not None:
            self._free.append(slot)

    def of(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter(
            (self._slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )


# An empty per-row array (a library call, so building a StepUpdate enters no
# function of this module).
_no_rows = functools.partial(np.zeros, 0, np.int64)


@dataclass
class StepUpdate:
    """What applying one step's scheduler decisions leaves for the step."""

    # The input batch, holding exactly this step's requests in row order.
    batch: InputBatch

    # [num_reqs] each batch row's token slot.
    token_slots: np.ndarray = field(default_factory=_no_rows)
    # [num_reqs] tokens each row runs as prompt chunks, all known on the
    # host: its prompt, or after a preemption its prompt and the outputs it
    # runs again. A row past them decodes: its input is a sampled token.
    prompt_lens: np.ndarray = field(default_factory=_no_rows)
    # Requests that left, with their histories (may still end in placeholders).
    finished: list[tuple[str, list[int]]] = field(default_factory=list)
    # Prompt chunks whose logprobs the forward computes, and the buffers that
    # are complete after this step (returned with its output).
    prompt_logprobs_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # [num_reqs] each row's tokens as the scheduler counts them (prompt +
    # outputs + in-flight placeholders). With speculation the host may know
    # a step's accepted count before the scheduler does, so a decode row is
    # told by this count, never by the host's.
    scheduled_num_tokens: np.ndarray = field(default_factory=_no_rows)
    # [num_reqs] the prompt tokens a new request's prefix-cache hit gave it
    # (0 on every other row): a step that writes the device histories (the
    # n-gram proposer reads them) writes those too.
    num_cached_prompt_tokens: np.ndarray = field(default_factory=_no_rows)
    # The batch's change for the device's logits processors and histories
    # (``sampling_state.py``); None: nothing changed.
    batch_change: BatchChange | None = None


class HostRequestState:
    def __init__(
        self,
        vocab_size: int,
        max_num_reqs: int,
        max_num_tokens: int,
    ) -> None:
        self.slots = TokenSlots(max_num_reqs)
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> tokens a preempted request runs as prompt chunks again
        # (its prompt and the outputs the scheduler kept).
        self.resumed_prompt_lens: dict[str, int] = {}
        # req_id -> prompt logprobs wanted, until its last prompt chunk ran.
        self.num_prompt_logprobs: dict[str, int] = {}
        self.input_batch: InputBatch | None = None
        # The input batch's logits processors: a recorder of its changes,
        # which the device's processors take (``sampling_state.py``).
        self._recorder = BatchUpdateRecorder()

    def allocate_batch(
        self, block_sizes: list[int], max_model_len: int, **kwargs: Any
    ) -> InputBatch:
        """The persistent batch, once the KV cache's block sizes are known.
        ``kwargs``: more of ``InputBatch``'s arguments."""
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=torch.device("cpu"),
            vocab_size=self.vocab_size,
            block_sizes=block_sizes,
            max_num_blocks_per_req=[cdiv(max_model_len, bs) for bs in block_sizes],
            logitsprocs=LogitsProcessors([self._recorder]),
            **kwargs,
        )
        return self.input_batch

    @property
    def batch(self) -> InputBatch:
        assert self.input_batch is not None, "no KV cache yet"
        return self.input_batch

    # ---- the scheduler's decisions -----------------------------------------

    def update(
        self, scheduler_output: "SchedulerOutput", retired: "Retired" = ()
    ) -> StepUpdate:
        """The ``retired`` steps' tokens, then the scheduler's decisions: the
        batch ends up holding exactly this step's requests, in the row order
        of the step's inputs."""
        batch = self.batch
        self.fill_placeholders(retired)
        update = StepUpdate(batch)
        self._drop_finished(scheduler_output.finished_req_ids, update)
        for req_id in scheduler_output.preempted_req_ids or ():
            self.slots.release(req_id)  # a resumed request joins anew
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (
            scheduled - cached.resumed_req_ids
        ):
            batch.remove_request(req_id)
        to_add = [self._new_request(new) for new in scheduler_output.scheduled_new_reqs]
        scheduled_num_tokens = self._apply_cached(cached, to_add)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()
        update.batch_change = self._batch_change(
            to_add,
            len(scheduler_output.scheduled_new_reqs),
            cached.resumed_req_ids,
            [req_id for req_id, _ in update.finished],
        )
        req_ids = list(batch.req_ids)
        update.token_slots = self.slots.of(req_ids)
        update.prompt_lens = self._per_row(
            req_ids, lambda r: self.resumed_prompt_lens.get(r)
        )
        update.scheduled_num_tokens = self._per_row(req_ids, scheduled_num_tokens.get)
        update.num_cached_prompt_tokens = self._cached_prompt_tokens(
            scheduler_output.scheduled_new_reqs, cached
        )
        if self.num_prompt_logprobs:
            self._prompt_logprobs(scheduler_output.num_scheduled_tokens, update)
        return update

    def _batch_change(
        self,
        added: list[CachedRequestState],
        num_new: int,
        resumed: set[str],
        finished: list[str],
    ) -> BatchChange | None:
        """What vLLM's input batch told its processors this step, each added
        request named by its id, with (a copy of) the outputs its device
        history starts from when it is new (``added[:num_new]``) or resumed;
        and the requests that finished."""
        updates = self._recorder.updates
        batch_update = updates.pop() if updates else None
        if batch_update is None and not finished:
            return None
        rows = []
        if batch_update is not None:
            req_id_of = {id(state.output_token_ids): state.req_id for state in added}
            starting = {state.req_id for state in added[:num_new]} | resumed
            for index, params, prompt, history in batch_update.added:
                req_id = req_id_of[id(history)]
                start = list(history) if req_id in starting else None
                rows.append((index, params, prompt, req_id, start))
        return BatchChange(
            batch_size=self.batch.num_reqs,
            removed=() if batch_update is None else batch_update.removed,
            added=rows,
            moved=() if batch_update is None else batch_update.moved,
            finished=finished,
        )

    def _drop_finished(self, finished_req_ids: set[str], update: StepUpdate) -> None:
        for req_id in finished_req_ids:
            if (state := self.requests.pop(req_id, None)) is not None:
                self.slots.release(req_id)
                update.finished.append((req_id, state.output_token_ids))
            self.num_prompt_logprobs.pop(req_id, None)
            self.resumed_prompt_lens.pop(req_id, None)
            self.batch.remove_request(req_id)

    def _apply_cached(
        self, cached: Any, to_add: list[CachedRequestState]
    ) -> dict[str, int]:
        """The running and resumed requests' new computed tokens, outputs and
        blocks; those no longer in the batch join ``to_add``. Returns each
        one's tokens as the scheduler counts them."""
        batch = self.batch
        scheduled_num_tokens: dict[str, int] = {}
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            num_output_tokens = cached.num_output_tokens[i]
            scheduled_num_tokens[req_id] = state.num_prompt_tokens + num_output_tokens
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted: it runs its prompt and the outputs the scheduler
                # kept again, as prompt chunks, from a history of its own.
                state.block_ids = new_block_ids
                self.slots.assign(req_id)
                _resume_history(state, cached.all_token_ids, num_output_tokens)
                self.resumed_prompt_lens[req_id] = (
                    state.num_prompt_tokens + num_output_tokens
                )
            else:
                del state.output_token_ids[num_output_tokens:]
                if new_block_ids is not None:
                    for ids, new_ids in zip(state.block_ids, new_block_ids):
                        ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            batch.num_tokens_no_spec[row] = state.num_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, row)
        return scheduled_num_tokens

    def _per_row(
        self, req_ids: list[str], value: Callable[[str], int | None]
    ) -> np.ndarray:
        """[num_reqs] ``value(req_id)``, the prompt's length where it is None."""
        return np.fromiter(
            (
                n if (n := value(r)) is not None else self.requests[r].num_prompt_tokens
                for r in req_ids
            ),
            dtype=np.int64,
            count=len(req_ids),
        )

    def _cached_prompt_tokens(self, new_reqs: list[Any], cached: Any) -> np.ndarray:
        """[num_reqs] the prefix-cache hit of each request that joins with a
        fresh token slot (new, or resumed after a preemption), 0 elsewhere
        (the batch is condensed: its rows are the step's)."""
        batch = self.batch
        hits = np.zeros(batch.num_reqs, np.int64)
        for new in new_reqs:
            hits[batch.req_id_to_index[new.req_id]] = new.num_computed_tokens
        for req_id in cached.resumed_req_ids:
            if (row := batch.req_id_to_index.get(req_id)) is not None:
                hits[row] = self.requests[req_id].num_computed_tokens
        return hits

    def _new_request(self, new: Any) -> CachedRequestState:
        params = new.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            prompt_embeds=new.prompt_embeds,
            mm_features=new.mm_features,
            sampling_params=params,
            pooling_params=new.pooling_params,
            generator=generator,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
        )
        self.requests[new.req_id] = state
        self.slots.assign(new.req_id)
        if params is not None and params.prompt_logprobs is not None:
            wanted = params.prompt_logprobs
            self.num_prompt_logprobs[new.req_id] = (
                self.vocab_size if wanted == -1 else wanted
            )
        return state

    # ---- sampled tokens: placeholders at enqueue, filled at retirement -----

    def add_placeholders(
        self, req_ids: list[str], num_new_tokens: np.ndarray
    ) -> Placeholders:
        """Each sampling row's history grows by its placeholders now
        (``num_new_tokens[row]``: one, or 1 + drafts for a verify row, as the
        scheduler counts them), so the next step's shapes are right before
        the tokens are known."""
        batch = self.batch
        width = batch.token_ids_cpu.shape[1]
        placeholders: Placeholders = {}
        for row in np.flatnonzero(num_new_tokens).tolist():
            count = int(num_new_tokens[row])
            start = int(batch.num_tokens_no_spec[row])
            batch.token_ids_cpu[row, start : min(start + count, width)] = (
                PLACEHOLDER_TOKEN_ID
            )
            batch.num_tokens_no_spec[row] = start + count
            req_id = req_ids[row]
            history = self.requests[req_id].output_token_ids
            placeholders[req_id] = (history, len(history), count)
            history.extend([PLACEHOLDER_TOKEN_ID] * count)
        return placeholders

    def fill_placeholders(self, retired: "Retired") -> None:
        """Retired steps' tokens into the histories (finished requests'
        too), oldest step first. A row that left ``count`` placeholders gets
        1 to ``count`` tokens (a verify step fills as many as it accepted and
        drops the rest). A history that was cut or replaced since
        (preemption) keeps what it has."""
        for placeholders, output in retired:
            self._fill(placeholders, output)

    def _fill(self, placeholders: Placeholders, output: "ModelRunnerOutput") -> None:
        batch = self.batch
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            history, index, count = placeholders.get(req_id, (None, 0, 0))
            if history is None or not tokens:
                continue
            index = _first_placeholder(history, index)
            if index is None:
                continue
            end = index
            while (
                end < min(len(history), index + count)
                and history[end] == PLACEHOLDER_TOKEN_ID
            ):
                end += 1
            filled = tokens[: end - index]
            history[index:end] = filled
            state = self.requests.get(req_id)
            row = batch.req_id_to_index.get(req_id)
            if row is None or state is None or state.output_token_ids is not history:
                continue
            start = state.num_prompt_tokens + index
            width = batch.token_ids_cpu.shape[1]
            if len(filled) == end - index:  # as many tokens as placeholders
                filled = filled[: width - start]
                batch.token_ids_cpu[row, start : start + len(filled)] = filled
                continue
            # Fewer (rejected drafts): the later placeholders moved back.
            tail = history[index : index + width - start]
            batch.token_ids_cpu[row, start : start + len(tail)] = tail
            batch.num_tokens_no_spec[row] = state.num_prompt_tokens + len(history)

    # ---- prompt logprobs ----------------------------------------------------

    def _prompt_logprobs(
        self, num_scheduled_tokens: dict[str, int], update: StepUpdate
    ) -> None:
        """Each scheduled prompt chunk's logprobs job, into its request's
        buffer; a buffer is complete with the prompt's last chunk."""
        batch = self.batch
        for req_id, num_logprobs in list(self.num_prompt_logprobs.items()):
            row = batch.req_id_to_index.get(req_id)
            state = self.requests[req_id]
            if row is None or state.prompt_token_ids is None:
                continue
            prompt = state.prompt_token_ids
            buffer = state.in_progress_prompt_logprobs_cpu
            if buffer is None:
                buffer = LogprobsTensors.empty_cpu(len(prompt) - 1, num_logprobs + 1)
                state.in_progress_prompt_logprobs_cpu = buffer
            start = state.num_computed_tokens
            num_scheduled = num_scheduled_tokens[req_id]
            num_logits = min(num_scheduled, len(prompt) - 1 - start)
            if num_logits > 0:
                targets = torch.tensor(prompt[start + 1 : start + 1 + num_logits])
                update.prompt_logprobs_jobs.append(
                    (row, start, targets, num_logprobs, buffer)
                )
            if start + num_scheduled >= len(prompt):
                update.prompt_logprobs[req_id] = buffer
                del self.num_prompt_logprobs[req_id]
                state.in_progress_prompt_logprobs_cpu = None

    # ---- TP consistency -----------------------------------------------------

    def history_digest(self) -> str:
        """The live requests' histories and batch rows, digested: equal on
        every TP rank when no rank drifts (``get_rank_state``)."""
        batch = self.batch
        digest = hashlib.sha256()
        for req_id in sorted(self.requests):
            state = self.requests[req_id]
            digest.update(f"{req_id}:{state.output_token_ids};".encode())
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                num_tokens = int(batch.num_tokens_no_spec[row])
                tokens = batch.token_ids_cpu[row, :num_tokens].tolist()
                digest.update(f"{tokens};".encode())
        return digest.hexdigest()


def _first_placeholder(history: list[int], index: int) -> int | None:
    """Where a retiring step's placeholders start, left at ``index``. A
    history is its tokens, then the placeholders of its steps in flight, in
    step order; steps retire in order, so the retiring step's are the first
    ones. An earlier verify step that filled fewer than it left moved them
    back, never forward: walk back from ``index`` over placeholders."""
    index = min(index, len(history))
    while index > 0 and history[index - 1] == PLACEHOLDER_TOKEN_ID:
        index -= 1
    if index < len(history) and history[index] == PLACEHOLDER_TOKEN_ID:
        return index
    return None


def _resume_history(
    state: CachedRequestState, all_token_ids: dict[str, list[int]], num_output: int
) -> None:
    """A preempted request's history from now on: the outputs the scheduler
    kept, as a new list. A step that sampled for it before the preemption
    may still be in flight, and vLLM may drop that output (a same-step
    resume): when the step retires, its placeholder is filled in the old
    list, never at the position the re-prefill samples again."""
    history = state.output_token_ids[:num_output]
    if PLACEHOLDER_TOKEN_ID in history:
        # Tokens the scheduler has and this worker has not retired yet.
        prompt = state.num_prompt_tokens
        history = list(all_token_ids[state.req_id][prompt : prompt + num_output])
    state.output_token_ids = history
