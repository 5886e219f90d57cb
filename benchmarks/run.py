"""How much async scheduling buys: ``python -m benchmarks.run [--quick]``.

Each engine configuration runs in its own subprocess (``benchmarks.child``),
one after the other, so they never compete for the cores:

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
from benchmarks.child import PROGRESS_MARKER, RESULT_MARKER
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


def run_child(
    spec: dict[str, Any], env: dict[str, str], log: Path, bar: tqdm, timeout_s: float
) -> dict[str, Any]:
    """Runs one configuration; its logs (stdout and stderr) go to ``log``."""
    deadline = time.monotonic() + timeout_s
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        result = None
        for line in proc.stdout:
            if line.startswith(PROGRESS_MARKER):
                bar.update(1)
            elif line.startswith(RESULT_MARKER):
                result = json.loads(line[len(RESULT_MARKER) :])
            else:  # vLLM logs to stdout
                stderr.write(line)
            if time.monotonic() > deadline:
                proc.kill()
                break
        proc.wait()
    if result is None:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"child failed (rc {proc.returncode}), log {log}:\n{tail}")
    return result


def run_configs(
    specs: dict[tuple[str, str, str], dict[str, Any]], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every (model, mode, group) in turn: raw results per model and mode
    (a mode's overlap group merged into its main one), and each failed
    configuration's error; a failure does not stop the others."""
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    with tqdm(total=sum(num_units(s) for s in specs.values()), unit="run") as bar:
        for (model, mode, group), spec in specs.items():
            name = f"{model}/{mode}" + ("/overlap" if group == "overlap" else "")
            bar.set_description(name)
            log = args.out / f"{name.replace('/', '_')}.log"
            try:
                env = config_env(mode, group)
                result = run_child(spec, env, log, bar, args.timeout)
            except RuntimeError as exc:  # report it, run the others
                errors[name] = str(exc)[-2000:]
                bar.write(f"{name} failed, see {log}")
                continue
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
    parser.add_argument("--models", default=None, help="comma list: small,large")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list")
    parser.add_argument(
        "--workloads",
        default="steady,decode_heavy,burst,mixed,overlap",
        help="comma list: steady,decode_heavy,burst,mixed,overlap",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200, help="s per config")
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
