"""Many engine starts in a row, each in its own process: crashes that strike
one start in several (a race in the first steps) show only this way.

    python -m vllm_neuron_sched.testing.stress_starts --starts 30 --device thread
    python -m vllm_neuron_sched.testing.stress_starts --starts 30 --sim-device-ms 5
    python -m vllm_neuron_sched.testing.stress_starts --starts 10 --mode sync \
        --device thread

Each start builds ``LLM(...)`` with the embedded tiny checkpoint, generates a
warm-up of 4 requests, then 48 more (prompts of 8-120 tokens, max_tokens
8-96, greedy, ``ignore_eos``), checks every request got its max_tokens, and
exits. A start that dies, hangs or returns short outputs counts as a failure
and its log is kept. Opt-in: not part of the test suite (minutes per run).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_neuron_sched.testing.checkpoint import ensure_checkpoint

_MODULE = "vllm_neuron_sched.testing.stress_starts"
_MARKER = "STRESS_START_OK:"
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "max_model_len": 512,
    "seed": 0,
}


def _requests(seed: int, num: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(8, 900) for _ in range(rng.randint(8, 120))] for _ in range(num)
    ]
    return prompts, [rng.randint(8, 96) for _ in range(num)]


def _one_start(model: str, is_async: bool) -> None:
    """The child: one engine, the warm-up and the main batch."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, async_scheduling=is_async, **ENGINE)
    num_tokens = 0
    for seed, num in ((0, 4), (1, 48)):
        prompts, max_tokens = _requests(seed, num)
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in max_tokens
        ]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != max_tokens:
            raise SystemExit(f"short outputs: {got} != {max_tokens}")
        num_tokens += sum(got)
    stats = llm.collective_rpc("get_async_scheduling_stats")[0]
    print(_MARKER + json.dumps({"tokens": num_tokens, **stats}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument(
        "--sim-device-ms", type=float, default=0.0, help="simulated device latency"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="VLLM_NEURON_SCHED_DEVICE (thread: the worker's two threads share "
        "vLLM's process-global state, where races live)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--model", help="checkpoint (default: the embedded one)")
    parser.add_argument(
        "--logs", default=None, help="where failed starts' logs go (default: a tmp dir)"
    )
    args = parser.parse_args()

    model = args.model or str(ensure_checkpoint())
    logs = Path(args.logs or tempfile.mkdtemp(prefix="stress_starts_"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_NEURON_SCHED_SIM_DEVICE_MS": str(args.sim_device_ms),
        "VLLM_NEURON_SCHED_DEVICE": args.device,
    }
    print(
        f"{args.starts} starts, {args.mode}, device {args.device}, simulated device "
        f"{args.sim_device_ms} ms, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    failures = 0
    for start in range(1, args.starts + 1):
        began = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", _MODULE, "--child", model, args.mode],
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
                env=env,
            )
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT"
            rc = None
        result = next(
            (ln for ln in output.splitlines() if ln.startswith(_MARKER)), None
        )
        elapsed = time.monotonic() - began
        if result is not None and rc == 0:
            print(f"start {start}: ok in {elapsed:.0f} s {result[len(_MARKER) :]}")
        else:
            failures += 1
            log = logs / f"start_{start}.log"
            log.write_text(output)
            tail = [ln for ln in output.splitlines() if ln.strip()][-3:]
            print(f"start {start}: FAILED (rc {rc}) in {elapsed:.0f} s, log {log}")
            for line in tail:
                print(f"    {line[:200]}")
        sys.stdout.flush()
    print(f"{failures} of {args.starts} starts failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _one_start(sys.argv[2], sys.argv[3] == "async")
    else:
        sys.exit(main())
