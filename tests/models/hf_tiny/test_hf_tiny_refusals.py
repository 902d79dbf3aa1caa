"""Real tiny checkpoints out of the backend's scope (built with transformers' own classes and
processors): a hybrid (LFM2-VL: convolution layers) and a cross-attention decoder (Mllama) are
refused by the backend with the reason and the model_impl to try (a native family where mmkit
has one), before any weight is read (their weights file is replaced by garbage: reading it would
fail differently)."""

from __future__ import annotations

import shutil

import pytest

from hf_tiny_cases import hf_tiny  # noqa: F401 - the fixture
from mmkit import LLM, ModelRegistry
from mmkit.testing.hf_tiny import SPECS, hf_tiny_names


@pytest.mark.parametrize("name", hf_tiny_names(refused=True))
def test_refused_before_weights_load(hf_tiny, tmp_path, name):
    spec = SPECS[name]
    native = spec.architecture in ModelRegistry.get_supported_archs()
    path = shutil.copytree(hf_tiny(name), tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    # model_impl="auto" refuses too where mmkit has no native family (with one, auto runs it).
    for model_impl in ["transformers"] + ([] if native else ["auto"]):
        with pytest.raises(ValueError) as info:
            LLM(str(path), dtype="float32", model_impl=model_impl)
        message = str(info.value)
        assert spec.architecture in message and spec.refused in message, message
        assert "model_impl='transformers'" in message, message
        # What would run it: the native family, else a registered implementation.
        assert ("model_impl='mmkit'" if native else "register_model") in message, message
    if not native:
        with pytest.raises(ValueError, match=spec.refused):
            ModelRegistry.get_implementation(spec.architecture)


def test_the_refused_checkpoints_run_in_transformers(hf_tiny):
    """They are real checkpoints (the refusal is about mmkit, not a broken folder)."""
    from transformers import AutoModelForImageTextToText

    for name in hf_tiny_names(refused=True):
        model = AutoModelForImageTextToText.from_pretrained(str(hf_tiny(name)))
        assert type(model).__name__ == SPECS[name].architecture


def test_per_layer_token_inputs_are_refused_by_name(tmp_path):
    """Gemma 4's decoder layers read per-layer embeddings of the token ids, which the backend
    (merged embeddings in) cannot give: refused from config.json, not run wrong."""
    from transformers import Gemma4Config

    config = Gemma4Config()
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"Gemma4ForConditionalGeneration cannot run with model_impl='transformers': "
                                         r"its decoder layers read per-layer embeddings of the token ids "
                                         r"\(hidden_size_per_layer_input=256\)"):
        LLM(str(tmp_path), dtype="float32", model_impl="transformers")
