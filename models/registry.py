"""Maps HF `architectures[0]` to mmkit's implementation."""

from __future__ import annotations

from typing import Any

# architecture -> (module under mmkit.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("mmkit.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("mmkit.models.llava_next", "LlavaNextForConditionalGeneration"),
    "LlavaOnevisionForConditionalGeneration": ("mmkit.models.llava_next", "LlavaOnevisionForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("mmkit.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("mmkit.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}
# Families whose own module fixes the decoder and vision tower (no per-part check below).
_SELF_CONTAINED = {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
# HF model_type of text_config -> the mmkit decoder that computes it exactly.
_TEXT_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("mmkit.models.llama", "LlamaModel"),
    "mistral": ("mmkit.models.llama", "LlamaModel"),
    "qwen2": ("mmkit.models.llama", "LlamaModel"),
    "qwen3": ("mmkit.models.qwen3", "Qwen3Model"),
}
SUPPORTED_TEXT_MODELS = tuple(_TEXT_MODELS)
SUPPORTED_VISION_MODELS = ("clip_vision_model", "siglip_vision_model")


# An old config without `architectures` is resolved by its model_type.
_BY_MODEL_TYPE = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                  "llava_onevision": "LlavaOnevisionForConditionalGeneration",
                  "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:  # an old config without `architectures`: go by model_type
        archs = [_BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None))]
    arch = archs[0] if archs else None
    if arch not in _MODELS:
        raise ValueError(
            f"model: architecture {arch!r} is not supported; supported architectures: "
            f"{supported_architectures()}"
        )
    if arch in _SELF_CONTAINED:
        return arch
    text_type = getattr(hf_config.get_text_config(), "model_type", None)
    if text_type not in SUPPORTED_TEXT_MODELS:
        raise ValueError(
            f"model: {arch} with a {text_type!r} language model is not supported; supported "
            f"language models: {list(SUPPORTED_TEXT_MODELS)}"
        )
    vision = getattr(hf_config, "vision_config", None)
    vision_type = getattr(vision, "model_type", None)
    if vision_type not in SUPPORTED_VISION_MODELS:
        raise ValueError(
            f"model: {arch} with a {vision_type!r} vision tower is not supported; supported vision "
            f"towers: {list(SUPPORTED_VISION_MODELS)}"
        )
    return arch


def text_model_class(text_config: Any):
    """The decoder class for a composite model's `text_config` (checked by `resolve_architecture`)."""
    import importlib

    module_name, class_name = _TEXT_MODELS[text_config.model_type]
    return getattr(importlib.import_module(module_name), class_name)


def get_model_class(architecture: str):
    import importlib

    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
