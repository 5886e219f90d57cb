"""The demo says what went wrong on the terminal, before any engine starts."""

import os
import subprocess
import sys


def test_a_malformed_variable_is_named_with_its_accepted_form() -> None:
    env = {**os.environ, "VLLM_NEURON_SCHED_SIM_DEVICE_MS": "fast"}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_neuron_sched.demo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "VLLM_NEURON_SCHED_SIM_DEVICE_MS='fast'" in proc.stderr
    assert "expected milliseconds, a number >= 0" in proc.stderr
    assert "running" not in proc.stdout  # no mode was started
