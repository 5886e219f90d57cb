"""The real model's maker says what is missing and how to get it, before it
fetches anything (the e2e test on the model is tests/e2e/test_real_model.py)."""

import importlib.util
from pathlib import Path

import pytest

from vllm_neuron_sched.testing import real_model


def test_a_missing_package_is_named_with_the_extra_that_brings_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "gguf" else find_spec(name, *args),
    )
    with pytest.raises(real_model.RealModelUnavailable) as info:
        real_model.ensure_real_checkpoint(tmp_path / "smollm2")
    assert "needs gguf" in str(info.value)
    assert 'pip install -e ".[test,bench,real]"' in str(info.value)
    assert not (tmp_path / "smollm2").exists()  # nothing half made


def test_a_made_checkpoint_is_used_as_it_is(tmp_path: Path) -> None:
    """The marker is written last: where it is, the checkpoint is complete
    and nothing is fetched or converted again."""
    (tmp_path / real_model._MARKER).write_text("{}")
    assert real_model.ensure_real_checkpoint(tmp_path) == tmp_path
