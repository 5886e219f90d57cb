"""The worker: vLLM's CPU worker (thread binding, distributed init, memory
sizing) with our model runner in place of ``CPUModelRunner``."""

from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from vllm.platforms import current_platform
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_neuron_sched.metrics import COUNTERS, CounterPublisher
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
        self._counters: CounterPublisher | None = None
        current_platform.set_workers_per_node(self.parallel_config.local_world_size)
        if self.model_config.runner_type != "generate":
            # Pooling runs whole static batches, synchronously: vLLM's runner.
            super().init_device()
            return
        with mock.patch.object(cpu_worker, "CPUModelRunner", NeuronSchedModelRunner):
            super().init_device()
        if self.model_runner.tp_rank == 0:
            # data_parallel_index: the replica, also for dense models, whose
            # data_parallel_rank vLLM resets to 0 in every engine core.
            self._counters = CounterPublisher.from_env(
                model_name=self.model_config.served_model_name,
                engine=self.parallel_config.data_parallel_index,
            )

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: "SchedulerOutput"
    ) -> "ModelRunnerOutput | None":
        """Enqueues the step's forward; None means sample_tokens() follows."""
        output = self.model_runner.execute_model(scheduler_output)
        if self._counters is not None:
            self._counters.publish(self.model_runner.get_async_scheduling_stats())
        return output

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: "GrammarOutput | None"
    ) -> "ModelRunnerOutput | AsyncModelRunnerOutput":
        """Enqueues on-device sampling; async mode returns a future output."""
        return self.model_runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        """Stops the device thread first: torch work running in it while the
        interpreter tears the process down aborts it."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.shutdown()
        super().shutdown()

    def get_async_scheduling_stats(self) -> dict[str, int]:
        """The async flow's counters (``COUNTERS`` in metrics.py); reachable
        with ``LLM.collective_rpc("get_async_scheduling_stats")``. vLLM's own
        runner has no async flow: every counter is 0."""
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return dict.fromkeys(COUNTERS, 0)
        return self.model_runner.get_async_scheduling_stats()

    def get_rank_state(self) -> dict[str, Any]:
        """This rank's in-flight steps and host-history digest, for TP
        consistency checks: ``collective_rpc("get_rank_state")``."""
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return {}
        return self.model_runner.get_rank_state()

    def get_step_timeline(self, clear: bool = False) -> dict[str, Any] | None:
        """Recorded host/device intervals per step (worker/timeline.py), or
        None when not recording: the benchmarks' timeline."""
        timeline = getattr(self.model_runner, "timeline", None)
        return None if timeline is None else timeline.snapshot(clear)

    def set_step_timeline(self, is_on: bool) -> None:
        """Starts recording the step timeline (VLLM_NEURON_SCHED_TIMELINE=1 does
        from the start) or stops it, so a benchmark times only the runs it
        traces."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.set_step_timeline(is_on)

    def inject_device_fault(self, num_executions: int) -> None:
        """Reliability tests: the ``num_executions``-th device execution from
        now raises (``VLLM_NEURON_SCHED_FAULT_AT_EXECUTION`` counts from the
        start instead)."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.accelerator.fail_execution_after(num_executions)

    def set_sim_device_ms(self, sim_device_ms: float) -> None:
        """Changes the simulated device latency of a running engine, so a
        benchmark sweeps it without restarting (see envs.py)."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.accelerator.sim_device_s = sim_device_ms / 1000.0
