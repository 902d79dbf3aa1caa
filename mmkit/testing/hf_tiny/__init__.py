"""Tiny random checkpoints of architectures mmkit has no native code for, built offline with
transformers' own config, model and processor classes and saved with `save_pretrained`: what
the transformers backend (`model_impl="transformers"`) is verified on.

    from mmkit.testing.hf_tiny import build_hf_tiny, hf_tiny_names
    path = build_hf_tiny("llama4/moe", "/tmp/tiny-llama4")

One module per architecture (`mmkit/testing/hf_tiny/<family>.py`), each with two or more
configurations (`CONFIGS`: different tie flags, sizes, head layouts, MoE layouts); a name is
`<family>/<configuration>`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TinySpec", "SPECS", "build_hf_tiny", "hf_tiny_names"]


@dataclass(frozen=True)
class TinySpec:
    """How to build one tiny checkpoint and how its prompts are written."""

    architecture: str  # HF architectures[0]
    module: str  # under mmkit.testing.hf_tiny
    builder: str  # the module's build function
    config: str  # a key of the module's CONFIGS
    placeholder: str  # the prompt text standing for one image
    needs_image: bool = False  # the processor refuses a prompt without an image (PaliGemma)
    refused: str | None = None  # out of the backend's scope: the reason its refusal names


def _family(architecture: str, module: str, builder: str, configs: tuple[str, ...], placeholder: str,
            **kw: Any) -> dict[str, TinySpec]:
    return {f"{module}/{c}": TinySpec(architecture, module, builder, c, placeholder, **kw) for c in configs}


SPECS: dict[str, TinySpec] = {
    **_family("Llama4ForConditionalGeneration", "llama4", "build_tiny_llama4", ("moe", "interleaved"), "<|image|>"),
    **_family("Glm4vForConditionalGeneration", "glm4v", "build_tiny_glm4v", ("base", "gqa"),
              "<|begin_of_image|><|image|><|end_of_image|>"),
    **_family("Glm4vMoeForConditionalGeneration", "glm4v", "build_tiny_glm4v", ("moe", "moe_gqa"),
              "<|begin_of_image|><|image|><|end_of_image|>"),
    **_family("PaliGemmaForConditionalGeneration", "paligemma", "build_tiny_paligemma",
              ("paligemma", "paligemma2"), "<image>", needs_image=True),
    **_family("AyaVisionForConditionalGeneration", "aya_vision", "build_tiny_aya_vision", ("tiles", "single"),
              "<image>"),
    **_family("Cohere2VisionForConditionalGeneration", "cohere2_vision", "build_tiny_cohere2_vision",
              ("tiles", "wide"), "<|IMG_PATCH|>"),
    **_family("LightOnOcrForConditionalGeneration", "lighton_ocr", "build_tiny_lighton_ocr", ("base", "gqa"),
              "<|image_pad|>"),
    **_family("Ovis2ForConditionalGeneration", "ovis2", "build_tiny_ovis2", ("tiles", "single"), "<image>"),
    **_family("DeepseekVLForConditionalGeneration", "deepseek_vl", "build_tiny_deepseek_vl", ("base", "gqa"),
              "<image_placeholder>"),
    # Out of scope, for the refusal tests: a hybrid and a cross-attention decoder.
    **_family("Lfm2VlForConditionalGeneration", "lfm2_vl", "build_tiny_lfm2_vl", ("hybrid", "hybrid_tied"),
              "<image>", refused="hybrid model"),
    **_family("MllamaForConditionalGeneration", "mllama", "build_tiny_mllama", ("cross", "cross_two"), "<|image|>",
              refused="cross-attention layers"),
}


def hf_tiny_names(refused: bool = False) -> list[str]:
    """The `<family>/<configuration>` names `build_hf_tiny` builds: those the transformers
    backend runs, or (`refused=True`) those it refuses."""
    return sorted(name for name, spec in SPECS.items() if (spec.refused is not None) == refused)


def build_hf_tiny(name: str, out_dir: str | Path, **overrides: Any) -> Path:
    """Save the tiny checkpoint `name` (see `hf_tiny_names()`) into `out_dir` and return its path;
    `overrides` replace the configuration's builder arguments (seed, sizes, ...)."""
    if name not in SPECS:
        raise ValueError(f"no tiny checkpoint {name!r}; available: {hf_tiny_names()}")
    spec = SPECS[name]
    module = importlib.import_module(f"mmkit.testing.hf_tiny.{spec.module}")
    kwargs = {**module.CONFIGS[spec.config], **overrides}
    return getattr(module, spec.builder)(out_dir, **kwargs)
