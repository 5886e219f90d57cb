"""How much async scheduling buys: ``python -m benchmarks.run [--quick]``.

Each engine configuration runs in its own subprocess (``benchmarks.child``),
one after the other, so they never compete for the cores, or with
``--interleave`` each model's all alive at once, taking turns run by run, so
the same repeat of every mode runs seconds apart (the machine's drift over
minutes cancels in the paired ratios):

- ``stock``: stock vLLM CPU (``VLLM_NEURON_SCHED_DISABLE=1``), synchronous;
- ``stock_async``: vLLM's own CPU worker behind our platform, async forced on;
- ``sync`` / ``async``: our worker, async scheduling off / on (the default
  device backend); the ``overlap`` sweep runs in engines of its own with a
  device thread (the simulated device needs one).

Writes ``--json`` (default ``benchmarks/results/bench.json``) first, then a
Chrome trace and PNGs of the step timeline under ``--out``. See
benchmarks/README.md.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.analysis import check_plotting
from benchmarks.child import PROGRESS_MARKER, RESULT_MARKER, WAIT_MARKER
from benchmarks.configs import (
    MODES,
    config_env,
    config_groups,
    config_spec,
    ensure_models,
    num_units,
    workloads,
)
from benchmarks.report import machine, print_summary, write_artefacts
from benchmarks.summary import summarize


class Child:
    """One configuration's process (``benchmarks.child``); its logs (stdout
    and stderr) go to ``log``."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._stderr = log.open("w")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(spec) + "\n")
        if spec.get("interleave"):
            self._proc.stdin.flush()
        else:
            self._proc.stdin.close()

    def read(self, bar: tqdm, deadline: float) -> tuple[int, int] | dict[str, Any]:
        """Reads the child's output until it waits for its turn (the run's
        key) or ends (its result)."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(PROGRESS_MARKER):
                bar.update(1)
            elif line.startswith(WAIT_MARKER):
                workload, run = line.split()[1:]
                return int(workload), int(run)
            elif line.startswith(RESULT_MARKER):
                self._close()
                return json.loads(line[len(RESULT_MARKER) :])
            else:  # vLLM logs to stdout
                self._stderr.write(line)
            if time.monotonic() > deadline:
                break
        self._close(kill=True)
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(
            f"child failed (rc {self._proc.returncode}), log {self.log}:\n{tail}"
        )

    def go(self) -> None:
        """Starts the run the child waits for; a child that died meanwhile is
        reported by the ``read`` that follows."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("go\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass

    def _close(self, kill: bool = False) -> None:
        if kill:
            self._proc.kill()
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        self._proc.wait()
        self._stderr.close()


def _read_or_report(
    name: str,
    child: Child,
    bar: tqdm,
    deadline: float,
    errors: dict[str, str],
) -> tuple[int, int] | dict[str, Any] | None:
    """``child.read``, or None with the failure in ``errors``: a failed
    configuration is reported and the others run."""
    try:
        return child.read(bar, deadline)
    except RuntimeError as exc:
        errors[name] = str(exc)[-2000:]
        bar.write(f"{name} failed, see {child.log}")
        return None


def next_turns(waiting: dict[str, tuple[int, int]], round_index: int) -> list[str]:
    """The children whose next run comes first (the smallest key), rotated by
    the round so no mode always runs first."""
    key = min(waiting.values())
    names = [name for name, k in waiting.items() if k == key]
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def run_interleaved(
    children: dict[str, tuple[dict[str, Any], dict[str, str], Path]],
    bar: tqdm,
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every configuration alive at once, taking turns run by run: repeat r
    of each is seconds apart, not minutes. They start one at a time (so no
    start-up competes with another), and before each turn the others have
    been idle ``args.settle_s``: vLLM's worker spins for up to a second after
    its last message, on the cores every engine's worker is bound to."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    deadline = time.monotonic() + args.timeout * len(children)
    live: dict[str, Child] = {}
    waiting: dict[str, tuple[int, int]] = {}

    def advance(name: str) -> None:
        answer = _read_or_report(name, live[name], bar, deadline, errors)
        if isinstance(answer, tuple):
            waiting[name] = answer
            return
        if answer is not None:
            results[name] = answer
        del live[name]

    for name, (spec, env, log) in children.items():
        bar.set_description(f"{name} (starting)")
        live[name] = Child({**spec, "interleave": True}, env, log)
        advance(name)
    round_index = 0
    while waiting:
        for name in next_turns(waiting, round_index):
            del waiting[name]
            bar.set_description(name)
            time.sleep(args.settle_s)
            live[name].go()
            advance(name)
        round_index += 1
    return results, errors


def run_sequential(
    children: dict[str, tuple[dict[str, Any], dict[str, str], Path]],
    bar: tqdm,
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """One configuration after another, each alone on the machine."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for name, (spec, env, log) in children.items():
        bar.set_description(name)
        deadline = time.monotonic() + args.timeout
        answer = _read_or_report(name, Child(spec, env, log), bar, deadline, errors)
        assert not isinstance(answer, tuple), f"{name} waits for a turn"
        if answer is not None:
            results[name] = answer
    return results, errors


def run_configs(
    specs: dict[tuple[str, str, str], dict[str, Any]], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every (model, mode, group): raw results per model and mode (a mode's
    overlap group merged into its main one), and each failed configuration's
    error; a failure does not stop the others. ``--interleave`` runs each
    model's main configurations together, taking turns; the overlap sweeps
    (ours only, a simulated device) run alone."""
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    batches: dict[Any, dict[str, Any]] = {}  # children per batch, in order
    config_of: dict[str, tuple[str, str, str]] = {}
    for (model, mode, group), spec in specs.items():
        name = f"{model}/{mode}" + ("/overlap" if group == "overlap" else "")
        config_of[name] = (model, mode, group)
        log = args.out / f"{name.replace('/', '_')}.log"
        child = (spec, config_env(mode, group), log)
        batch_key = (model, group) if args.interleave and group == "main" else name
        batches.setdefault(batch_key, {})[name] = child
    with tqdm(total=sum(num_units(s) for s in specs.values()), unit="run") as bar:
        for children in batches.values():
            if args.interleave and len(children) > 1:
                results, failed = run_interleaved(children, bar, args)
            else:
                results, failed = run_sequential(children, bar, args)
            errors.update(failed)
            for name, result in results.items():
                model, mode, group = config_of[name]
                runs = raw.setdefault(model, {})
                if group == "main":
                    runs[mode] = {**result, **runs.get(mode, {})}
                else:
                    runs.setdefault(mode, {"workloads": {}})
                    runs[mode]["workloads"].update(result["workloads"])
    return raw, errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, ~3 min")
    parser.add_argument("--json", type=Path, default=None, help="report path")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--models", default=None, help="comma list: real,small,large")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list")
    parser.add_argument(
        "--workloads",
        default="steady,decode_heavy,burst,mixed,overlap",
        help="comma list: steady,decode_heavy,burst,mixed,overlap",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200, help="s per config")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="each model's engines alive at once, taking turns run by run",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="--interleave: idle seconds before each turn",
    )
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    check_plotting()  # before any engine starts, not after the last one
    models = (args.models or ("small" if args.quick else "small,large")).split(",")
    modes = [m for m in MODES if m in args.modes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or args.out / "bench.json"
    ensure_models(models)

    load_start = os.getloadavg()
    configs = [
        (model, mode, group)
        for model in models
        for mode in modes
        for group in config_groups(model, mode, args)
    ]
    specs = {c: config_spec(*c, args) for c in configs}
    raw, errors = run_configs(specs, args)
    report = {
        "command": " ".join(["python -m benchmarks.run", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "interleaved": args.interleave,
        "machine": machine(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "workloads": workloads(args.quick, args.repeats),
        **summarize(raw),
        "errors": errors,
        "startup_s": {
            model: {mode: r.get("startup_s") for mode, r in runs.items()}
            for model, runs in raw.items()
        },
    }
    # The figures first: a failing plot must not lose them.
    json_path.write_text(json.dumps(report, indent=2))
    (args.out / "raw.json").write_text(json.dumps(raw))
    try:
        report["artefacts"] = write_artefacts(raw, args, args.out)
    except Exception as exc:
        report["artefacts"] = {"error": repr(exc)}
        print(f"timeline artefacts failed ({exc!r}); the figures are in {json_path}")
    json_path.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"report: {json_path}")


if __name__ == "__main__":
    main()
