"""A device backend from a package of its own, as a Neuron or Spyre port would
ship one: registered under the ``vllm_neuron_sched.devices`` entry points, it
is picked by ``VLLM_NEURON_SCHED_DEVICE=<its kind>`` and runs the contract
suite by the documented command, with no edit to this repository."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pip builds and installs the package

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "echo-device"
version = "0.1"

[project.entry-points."vllm_neuron_sched.devices"]
echo = "echo_device:EchoDevice"
"""
MODULE = '''\
"""A port's backend: the contract, by way of the inline one."""

from vllm_neuron_sched.runtime import InlineDevice


class EchoDevice(InlineDevice):
    kind = "echo"
'''
CONFORMANCE = [
    sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
    "--pyargs", "vllm_neuron_sched.testing.conformance",
]  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The package, built and installed into a folder of its own; the
    environment that puts it on the path."""
    source = tmp_path_factory.mktemp("echo_device_src")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "echo_device").mkdir()
    (source / "echo_device" / "__init__.py").write_text(MODULE)
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target),
         str(source)],
        check=True,
    )  # fmt: skip
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_an_installed_backend_is_picked_by_its_kind(
    installed: dict[str, str], tmp_path: Path
) -> None:
    probe = textwrap.dedent(
        """
        from vllm_neuron_sched import envs
        from vllm_neuron_sched.runtime import make_device

        envs.check_values()  # the start-up check knows the kind
        device = make_device()
        print(type(device).__module__, type(device).__name__, device.kind)
        print(device.enqueue(lambda: 41 + 1).result())
        """
    )
    out = _run(
        [sys.executable, "-c", probe],
        {**installed, "VLLM_NEURON_SCHED_DEVICE": "echo"},
        tmp_path,
    )
    assert out.split("\n")[:2] == ["echo_device EchoDevice echo", "42"]


def test_an_unregistered_kind_is_refused_with_the_installed_ones(
    installed: dict[str, str], tmp_path: Path
) -> None:
    probe = "from vllm_neuron_sched import envs; envs.check_values()"
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        env={**installed, "VLLM_NEURON_SCHED_DEVICE": "neuron"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "expected one of auto, thread, inline, compiled, echo" in proc.stderr


def test_the_installed_backend_passes_the_contract_suite(
    installed: dict[str, str], tmp_path: Path
) -> None:
    out = _run(
        CONFORMANCE,
        {**installed, "VLLM_NEURON_SCHED_DEVICE": "echo"},
        tmp_path,
    )
    # Every kind-parametrized contract test ran on the port's kind, and passed.
    assert out.count("[echo] PASSED") >= 10
    assert not any(f"[{kind}]" in out for kind in ("thread", "inline", "compiled"))
    assert " FAILED" not in out and " ERROR" not in out
