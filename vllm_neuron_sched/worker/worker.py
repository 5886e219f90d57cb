"""The worker: vLLM's CPU worker (thread binding, distributed init, memory
sizing) with our model runner in place of ``CPUModelRunner``."""

import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.logger import init_logger
from vllm.platforms import CpuArchEnum, current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from vllm_neuron_sched.metrics import COUNTERS, CounterPublisher
from vllm_neuron_sched.runtime import make_device
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

logger = init_logger(__name__)


class NeuronSchedWorker(CPUWorker):
    model_runner: NeuronSchedModelRunner

    def init_device(self) -> None:
        """The CPU worker's device set-up, then our runner.

        ``CPUWorker.init_device`` ends by constructing ``CPUModelRunner``
        itself, with no hook to construct another, so for generation this
        does its set-up with vLLM's own functions, in its order (vLLM 0.32:
        the LD_PRELOAD advice, no ``torch.set_num_threads`` after the thread
        binding, the shared-memory name, distributed init, the seed), and
        then builds our runner with this worker's TP group and device.
        Pooling runs whole static batches synchronously: vLLM's runner.
        """
        self.use_v2_model_runner = False
        self._counters: CounterPublisher | None = None
        current_platform.set_workers_per_node(self.parallel_config.local_world_size)
        if self.model_config.runner_type != "generate":
            super().init_device()
            return
        self.device = torch.device("cpu")
        _advise_preloaded_libraries()
        torch.set_num_threads = _keep_bound_threads
        init_method = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init_method.removeprefix("file://"))
            if init_method.startswith("file://")
            else init_method.split(":")[-1]
        )
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        tp_group = get_tp_group()
        self.model_runner = NeuronSchedModelRunner(
            self.vllm_config,
            tp_group,
            make_device(label=f"tp{tp_group.rank_in_group}"),
            self.device,
        )
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
            self.model_runner.device.fail_execution_after(num_executions)

    def set_sim_device_ms(self, sim_device_ms: float) -> None:
        """Changes the simulated device latency of a running engine, so a
        benchmark sweeps it without restarting (see envs.py)."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.device.sim_device_s = sim_device_ms / 1000.0


def _advise_preloaded_libraries() -> None:
    """vLLM's CPU worker's advice: these allocators and OpenMP runtimes are
    much faster preloaded."""
    if not sys.platform.startswith("linux"):
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    libraries = ["libtcmalloc"]
    if current_platform.get_cpu_architecture() == CpuArchEnum.X86:
        libraries.append("libiomp")
    for name in libraries:
        if name not in preloaded:
            logger.warning(
                "%s is not found in LD_PRELOAD. For best performance, follow "
                "the section `set LD_PRELOAD` of vLLM's CPU installation guide.",
                name,
            )


def _keep_bound_threads(num_threads: int) -> None:
    """vLLM's CPU rule: the worker's OpenMP threads are bound to its cores
    before the model loads, and ``torch.set_num_threads`` would undo that."""
    logger.warning(
        "CPU backend doesn't allow to use `torch.set_num_threads` after the "
        "thread binding, skip it."
    )
