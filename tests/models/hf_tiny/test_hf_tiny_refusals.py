"""Real tiny checkpoints out of the backend's scope (built with transformers' own classes and
processors): a hybrid (LFM2-VL: convolution layers) and a cross-attention decoder (Mllama) are
refused with the reason and the model_impl to try, before any weight is read (their weights
file is replaced by garbage: reading it would fail differently)."""

from __future__ import annotations

import shutil

import pytest

from hf_tiny_cases import hf_tiny  # noqa: F401 - the fixture
from mmkit import LLM, ModelRegistry
from mmkit.testing.hf_tiny import SPECS, hf_tiny_names


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("name", hf_tiny_names(refused=True))
def test_refused_before_weights_load(hf_tiny, tmp_path, name, model_impl):
    spec = SPECS[name]
    path = shutil.copytree(hf_tiny(name), tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", model_impl=model_impl)
    message = str(info.value)
    assert spec.architecture in message and spec.refused in message, message
    assert "model_impl='transformers'" in message and "register_model" in message, message
    with pytest.raises(ValueError, match=spec.refused):
        ModelRegistry.get_implementation(spec.architecture)


def test_the_refused_checkpoints_run_in_transformers(hf_tiny):
    """They are real checkpoints (the refusal is about mmkit, not a broken folder)."""
    from transformers import AutoModelForImageTextToText

    for name in hf_tiny_names(refused=True):
        model = AutoModelForImageTextToText.from_pretrained(str(hf_tiny(name)))
        assert type(model).__name__ == SPECS[name].architecture
