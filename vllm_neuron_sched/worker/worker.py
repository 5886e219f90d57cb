"""The worker: vLLM's CPU worker (thread binding, distributed init, memory
sizing) with our model runner in place of ``CPUModelRunner``."""

from typing import TYPE_CHECKING
from unittest import mock

import torch
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


class NeuronSchedWorker(CPUWorker):
    model_runner: NeuronSchedModelRunner

    def init_device(self) -> None:
        """CPUWorker.init_device, constructing our runner instead of its own.

        The CPU worker builds ``CPUModelRunner`` by module-level name at the
        end of init_device; swapping that one name reuses everything before it
        (thread binding, distributed init, seeding) without copying it.
        """
        self.use_v2_model_runner = False
        if self.model_config.runner_type != "generate":
            # Pooling runs whole static batches, synchronously: vLLM's runner.
            super().init_device()
            return
        with mock.patch.object(cpu_worker, "CPUModelRunner", NeuronSchedModelRunner):
            super().init_device()

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: "SchedulerOutput"
    ) -> "ModelRunnerOutput | None":
        """Enqueues the step's forward; None means sample_tokens() follows."""
        return self.model_runner.execute_model(scheduler_output)

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: "GrammarOutput | None"
    ) -> "ModelRunnerOutput | AsyncModelRunnerOutput":
        """Enqueues on-device sampling; async mode returns a future output."""
        return self.model_runner.sample_tokens(grammar_output)

    def get_async_scheduling_stats(self) -> dict[str, int]:
        """async_steps, sync_fallback_steps, prefill_steps, dead_tokens;
        reachable with ``LLM.collective_rpc("get_async_scheduling_stats")``."""
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return {"async_steps": 0, "sync_fallback_steps": 0, "prefill_steps": 0}
        return self.model_runner.get_async_scheduling_stats()
