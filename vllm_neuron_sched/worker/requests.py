"""Per-request host state: vLLM's CachedRequestState and InputBatch, updated
from each SchedulerOutput on the worker's main thread only."""

from typing import TYPE_CHECKING, Any

import torch
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from vllm_neuron_sched.worker.inputs import PLACEHOLDER_TOKEN_ID, StepInputs

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_neuron_sched.runtime.device import Device
    from vllm_neuron_sched.worker.async_flow import AsyncFlow


class RequestStatesMixin:
    input_batch: "InputBatch"
    vocab_size: int
    flow: "AsyncFlow"
    accelerator: "Device"

    def zero_kv_blocks(self, block_ids: list[int]) -> None: ...

    def _init_request_states(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> prompt logprobs wanted, until its last prompt chunk ran.
        self.num_prompt_logprobs: dict[str, int] = {}

    def _update_states(self, scheduler_output: "SchedulerOutput") -> None:
        """Applies the scheduler's decisions to the persistent batch: the
        batch ends up holding exactly this step's requests."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            if (state := self.requests.pop(req_id, None)) is not None:
                self.flow.finish_request(req_id, state.output_token_ids)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        if block_ids := getattr(scheduler_output, "new_block_ids_to_zero", None):
            self.zero_kv_blocks(block_ids)

        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (
            scheduled - cached.resumed_req_ids
        ):
            batch.remove_request(req_id)

        to_add = [
            self._add_new_request(new) for new in scheduler_output.scheduled_new_reqs
        ]
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            num_output_tokens = cached.num_output_tokens[i]
            if num_output_tokens < len(state.output_token_ids):
                del state.output_token_ids[num_output_tokens:]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                self._recover_output_tokens(
                    state, cached.all_token_ids, num_output_tokens
                )
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            batch.num_tokens_no_spec[row] = state.num_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, row)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _add_new_request(self, new: Any) -> CachedRequestState:
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
        self.flow.tokens.assign(new.req_id, self.accelerator)
        if params is not None and params.prompt_logprobs is not None:
            wanted = params.prompt_logprobs
            self.num_prompt_logprobs[new.req_id] = (
                self.vocab_size if wanted == -1 else wanted
            )
        return state

    @staticmethod
    def _recover_output_tokens(
        state: CachedRequestState, all_token_ids: dict[str, list[int]], num_output: int
    ) -> None:
        """A request re-joining the batch: keep our exact history, or take the
        scheduler's if ours still holds placeholders (it was preempted)."""
        known = all_token_ids.get(state.req_id)
        if num_output and known and PLACEHOLDER_TOKEN_ID in state.output_token_ids:
            state.output_token_ids = known[-num_output:]

    def _prompt_logprobs_jobs(
        self, inputs: StepInputs
    ) -> tuple[list[tuple], dict[str, LogprobsTensors]]:
        """Device jobs that fill each row's prompt-logprobs buffer, and the
        buffers complete after this step (returned with its output)."""
        jobs: list[tuple] = []
        completed: dict[str, LogprobsTensors] = {}
        if not self.num_prompt_logprobs:
            return jobs, completed
        offsets = inputs.row_offsets.tolist()
        for row, req_id in enumerate(inputs.req_ids):
            num_logprobs = self.num_prompt_logprobs.get(req_id)
            state = self.requests[req_id]
            if num_logprobs is None or state.prompt_token_ids is None:
                continue
            prompt = state.prompt_token_ids
            buffer = state.in_progress_prompt_logprobs_cpu
            if buffer is None:
                buffer = LogprobsTensors.empty_cpu(len(prompt) - 1, num_logprobs + 1)
                state.in_progress_prompt_logprobs_cpu = buffer
            start = int(inputs.num_computed[row])
            num_scheduled = int(inputs.num_scheduled[row])
            num_logits = min(num_scheduled, len(prompt) - 1 - start)
            if num_logits > 0:
                targets = torch.tensor(prompt[start + 1 : start + 1 + num_logits])
                jobs.append((offsets[row], start, targets, num_logprobs, buffer))
            if start + num_scheduled >= len(prompt):
                completed[req_id] = buffer
                del self.num_prompt_logprobs[req_id]
                state.in_progress_prompt_logprobs_cpu = None
        return jobs, completed
