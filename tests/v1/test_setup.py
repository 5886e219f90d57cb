"""The README's one set-up command is what CI runs, and it leaves everything
the README runs working: the real extra installed, and ``import
transformers`` (which a registry torchvision breaks) working with it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_commands(text: str) -> list[str]:
    return re.findall(r"^pip install -e .*$", text, flags=re.MULTILINE)


def test_ci_runs_the_readmes_one_setup_command() -> None:
    readme = _setup_commands((ROOT / "README.md").read_text())
    ci = _setup_commands((ROOT / ".ci" / "run").read_text())
    assert len(readme) == 1, readme  # one command, no second install after it
    assert ci == readme
    assert "real" in readme[0] and "pip uninstall -y torchvision" in readme[0]


def test_the_real_extra_and_transformers_import_together() -> None:
    """In a fresh interpreter, as the demo starts: the real extra's packages
    are there, and transformers loads a Llama class (a registry torchvision
    beside this torch fails here with ``torchvision::nms does not exist``)."""
    code = (
        "import gguf, accelerate, transformers\n"
        "from transformers import AutoTokenizer, LlamaForCausalLM\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
