"""Device backends (thread, inline, compiled) and ``make_device``, which
picks one.

A port to real hardware is a package of its own that registers its ``Device``
subclass under the entry-point group ``vllm_neuron_sched.devices`` (name: its
``kind``); docs/design.md, section 9, says what it must implement and the one
command that runs the contract tests against it."""

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from importlib.metadata import entry_points

from vllm.logger import init_logger

from vllm_neuron_sched import envs
from vllm_neuron_sched.runtime.device import Device, Execution
from vllm_neuron_sched.runtime.future import DeviceShutdownError

logger = init_logger(__name__)

# The device thread's niceness: ahead of the host's threads on the cores.
DEVICE_THREAD_NICE = -10


class ThreadDevice(Device):
    """A one-worker ``ThreadPoolExecutor`` runs executions FIFO on its thread
    (named ``<label>_0``), so enqueue never waits.

    No lock is held while an execution runs: torch releases the GIL inside its
    kernels, so the host thread keeps scheduling while the device computes.

    The thread runs ahead of the host's threads on the cores (niceness
    ``DEVICE_THREAD_NICE``, where the process may raise it): it stands in
    for an accelerator, whose compute never waits for a host core. At equal
    priority, the threads that wake when a step's output is ready (the
    output thread, the engine, the next step's build) took the two cores
    from it just when its next step was queued: 0.3-0.5 ms of a 14 ms step
    at 5 ms simulated (benchmarks/README.md, "Overlap").

    The thread is not a daemon: the interpreter joins it at exit, after what
    is queued has run, instead of killing it inside a torch kernel while the
    interpreter tears down. A worker whose execution hangs (a collective whose
    peer died) therefore does not exit by itself; vLLM's executor kills such
    workers (SIGTERM, then SIGKILL, after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS).
    """

    kind = "thread"

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        super().__init__(label, sim_device_ms)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=label, initializer=_run_ahead_of_host
        )
        self._submit_lock = threading.Lock()  # shutdown sees the last submit
        self._last: Future[None] | None = None  # the newest execution's run

    def shutdown(self, timeout_s: float | None = None) -> None:
        with self._submit_lock:
            self._executor.shutdown(wait=False)  # queued executions still run
            last = self._last
        if last is not None and wait((last,), timeout_s).not_done:
            _warn_still_running(self, timeout_s)

    def _submit(self, execution: Execution) -> None:
        with self._submit_lock:
            try:
                self._last = self._executor.submit(self._run, execution)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                raise DeviceShutdownError(
                    f"device {self.label!r} is shut down"
                ) from None


def _run_ahead_of_host() -> None:
    """On the device thread, first: its niceness, where the process may."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DEVICE_THREAD_NICE)
    except OSError as error:  # no CAP_SYS_NICE: the host's priority
        logger.info("device thread keeps the host's priority (%s)", error)


class CompiledDevice(ThreadDevice):
    """A device thread whose programs are graphs compiled at start-up, one per
    declared shape, as a static-shape compiler (Neuron's NEFFs) makes them:
    the runner compiles the forward for every shape its buckets declare
    before serving, and a shape that would compile while serving fails its
    execution with ``ShapeNotCompiledError`` instead of running a graph
    nobody declared (docs/design.md, section 9)."""

    kind = "compiled"
    compiles_per_shape = True


class InlineDevice(Device):
    """Runs each execution at enqueue time, on the caller's thread: the CPU
    default, where the device is the worker's own cores. The futures and the
    flow are the same as on any other backend (only their timing differs), and
    errors still surface only at ``result()``, as on a real device."""

    kind = "inline"
    runs_at_enqueue = True

    def __init__(self, label: str = "device", sim_device_ms: float = 0.0) -> None:
        super().__init__(label, sim_device_ms)
        self._lock = threading.Lock()  # one execution at a time across callers
        self._is_shut_down = False

    def shutdown(self, timeout_s: float | None = None) -> None:
        self._is_shut_down = True  # nothing is queued; refuse enqueues from now
        # An execution another thread enqueued may still run: wait it out.
        if self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            self._lock.release()
        else:
            _warn_still_running(self, timeout_s)

    def _submit(self, execution: Execution) -> None:
        with self._lock:
            if self._is_shut_down:
                raise DeviceShutdownError(f"device {self.label!r} is shut down")
            self._run(execution)


def _warn_still_running(device: Device, timeout_s: float | None) -> None:
    logger.warning(
        "Device %s still running %s s into shutdown", device.label, timeout_s
    )


# Kind -> built-in backend. envs.BUILTIN_DEVICE_KINDS names them for the
# start-up check, in processes that never import a backend.
DEVICE_BACKENDS: dict[str, type[Device]] = {
    backend.kind: backend for backend in (ThreadDevice, InlineDevice, CompiledDevice)
}
assert ("auto", *DEVICE_BACKENDS) == envs.BUILTIN_DEVICE_KINDS, (
    f"envs.BUILTIN_DEVICE_KINDS {envs.BUILTIN_DEVICE_KINDS} must list 'auto' "
    f"and then exactly the built-in backends {tuple(DEVICE_BACKENDS)}"
)


def backend_of(kind: str) -> type[Device]:
    """The backend class of ``kind``: built in, or loaded from the installed
    package that registers it."""
    if kind in DEVICE_BACKENDS:
        return DEVICE_BACKENDS[kind]
    found = [
        ep
        for ep in entry_points(group=envs.DEVICE_ENTRY_POINTS)
        if ep.name.lower() == kind
    ]
    if not found:
        raise ValueError(
            f"unknown device kind {kind!r}; valid kinds: "
            f"{', '.join(envs.device_kinds())}"
        )
    backend = found[0].load()
    if not (isinstance(backend, type) and issubclass(backend, Device)):
        raise TypeError(
            f"entry point {found[0].value!r} ({envs.DEVICE_ENTRY_POINTS}: "
            f"{kind}) is not a subclass of vllm_neuron_sched.runtime.Device"
        )
    if backend.kind != kind:
        raise TypeError(
            f"entry point {found[0].value!r} is registered as {kind!r} but its "
            f"kind is {backend.kind!r}"
        )
    return backend


def make_device(
    kind: str | None = None, sim_device_ms: float | None = None, label: str = "device"
) -> Device:
    """The device a worker runs on, ``label`` naming it in threads, futures and
    logs; unset arguments come from ``envs`` (VLLM_NEURON_SCHED_DEVICE,
    VLLM_NEURON_SCHED_SIM_DEVICE_MS).

    ``auto`` picks ``inline`` when the device is the CPU worker's own cores
    and ``thread`` when executions also hold a simulated device. On the CPU
    a device thread can only time-slice with the worker's thread on the cores
    vLLM bound the worker to, and every torch op it dispatches takes the
    interpreter lock back from the host thread: measured, it loses to running
    inline (benchmarks/README.md). The overlap that async scheduling buys on
    the CPU is the engine core's, in its own process, which either backend
    keeps. A simulated (or real) device frees the worker's cores while it
    runs, and only a device thread lets the host use them meanwhile.
    """
    kind = (kind or envs.VLLM_NEURON_SCHED_DEVICE).lower()
    if sim_device_ms is None:
        sim_device_ms = envs.VLLM_NEURON_SCHED_SIM_DEVICE_MS
    if kind == "auto":
        kind = "thread" if sim_device_ms > 0 else "inline"
    backend = backend_of(kind)
    if sim_device_ms < 0:
        raise ValueError(f"sim_device_ms must be >= 0, got {sim_device_ms}")
    logger.debug(
        "Device %r: %s backend, simulated latency %.1f ms", label, kind, sim_device_ms
    )
    return backend(label, sim_device_ms)
