"""The worker: vLLM's CPU worker (thread binding, distributed init, memory
sizing) with our model runner in place of ``CPUModelRunner``."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_neuron_sched.metrics import COUNTERS, CounterPublisher
from vllm_neuron_sched.runtime import make_device
from vllm_neuron_sched.worker.model_runner import NeuronSchedModelRunner

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

logger = init_logger(__name__)


_TRANSFER = (
    "a trainer's weight transfer writes the weights from outside the device's "
    "order; load new weights with collective_rpc('reload_weights', kwargs="
    "{'weights_path': ...}) (or a weights_iterator) instead"
)
_CHECKPOINT = "checkpointing the process's distributed state is not run"


def _refused(name: str, why: str) -> Callable[..., Any]:
    """An RPC of vLLM's worker that ours does not run, refused by name with
    ``why``; vLLM's own runner (pooling models) keeps it."""

    def rpc(self: "NeuronSchedWorker", *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return getattr(CPUWorker, name)(self, *args, **kwargs)
        raise NotImplementedError(
            f"vllm_neuron_sched does not run the worker RPC {name!r}: {why}; or "
            "use stock vLLM CPU (VLLM_NEURON_SCHED_DISABLE=1)"
        )

    rpc.__name__ = rpc.__qualname__ = name
    return rpc


class NeuronSchedWorker(CPUWorker):
    model_runner: NeuronSchedModelRunner

    def init_device(self) -> None:
        """vLLM's CPU worker's device set-up (thread binding, distributed
        init, seed), building our runner where it builds ``CPUModelRunner``.
        Pooling runs whole static batches synchronously: vLLM's runner."""
        self.use_v2_model_runner = False
        self._counters: CounterPublisher | None = None
        # Ranks tell their node by device_count() (platform.py says why).
        current_platform.set_workers_per_node(self.parallel_config.local_world_size)
        if self.model_config.runner_type != "generate":
            super().init_device()
            return

        def our_runner(vllm_config: Any, device: torch.device) -> Any:
            # Made by the set-up, before this call.
            tp_group, pp_group = get_tp_group(), get_pp_group()
            label = f"tp{tp_group.rank_in_group}"
            if pp_group.world_size > 1:
                label = f"pp{pp_group.rank_in_group}{label}"
            return NeuronSchedModelRunner(
                vllm_config, tp_group, make_device(label=label), device, pp_group
            )

        with _runner_class(our_runner):
            super().init_device()
        if self.model_runner.tp_rank == 0 and get_pp_group().is_first_rank:
            # Rank 0, on the API server's node (with pipeline stages across
            # nodes the output rank is on the last): every rank counts the
            # same steps.
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

    def reset_weights(self) -> None:
        """vLLM zeroes the weights on the calling thread; an execution in
        flight may read them: ours is a state update on the device."""
        if isinstance(self.model_runner, NeuronSchedModelRunner):
            self.model_runner.reset_weights()
        else:
            super().reset_weights()

    # vLLM's worker RPCs that ours does not run (docs/vllm-options.md lists
    # every RPC and what each does here).
    execute_dummy_batch = _refused(
        "execute_dummy_batch",
        "it runs an idle data-parallel replica's dummy batch of a MoE model, "
        "which is refused at start-up",
    )
    init_weight_transfer_engine = _refused("init_weight_transfer_engine", _TRANSFER)
    start_weight_update = _refused("start_weight_update", _TRANSFER)
    start_draft_weight_update = _refused("start_draft_weight_update", _TRANSFER)
    update_weights = _refused("update_weights", _TRANSFER)
    finish_weight_update = _refused("finish_weight_update", _TRANSFER)
    handle_ft_command = _refused("handle_ft_command", "fault tolerance is not run")
    elastic_ep_execute = _refused(
        "elastic_ep_execute", "elastic expert parallel is not run"
    )
    checkpoint_prepare = _refused("checkpoint_prepare", _CHECKPOINT)
    checkpoint_restore = _refused("checkpoint_restore", _CHECKPOINT)

    def get_async_scheduling_stats(self) -> dict[str, int]:
        """The async flow's counters (``COUNTERS`` in metrics.py); reachable
        with ``LLM.collective_rpc("get_async_scheduling_stats")``. vLLM's own
        runner has no async flow: every counter is 0."""
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return dict.fromkeys(COUNTERS, 0)
        return self.model_runner.get_async_scheduling_stats()

    def get_compiled_shapes(self) -> dict[str, Any]:
        """The shapes the compiled device declared (None on other devices)
        and the graphs dynamo holds for the forwards (its own cache entries):
        ``collective_rpc("get_compiled_shapes")``."""
        if not isinstance(self.model_runner, NeuronSchedModelRunner):
            return {"declared": None, "forward_graphs": 0}
        return self.model_runner.get_compiled_shapes()

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


@contextmanager
def _runner_class(factory: Callable[[Any, torch.device], Any]) -> Iterator[None]:
    """``CPUWorker.init_device`` ends by constructing the module global
    ``cpu_worker.CPUModelRunner(vllm_config, device)``, with no hook for
    another runner: for that one call the name builds ours. Building vLLM's
    runner and replacing it would allocate its input batch and buffers for
    nothing."""
    original = getattr(cpu_worker, "CPUModelRunner", None)
    if original is None:
        raise RuntimeError(
            "vllm.v1.worker.cpu_worker has no CPUModelRunner: this vLLM builds "
            "its CPU runner another way (vllm_neuron_sched is built for vLLM 0.32)"
        )
    cpu_worker.CPUModelRunner = factory
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original
