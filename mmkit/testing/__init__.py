"""Tiny random checkpoints of every supported family, built offline with transformers' own
config, model and processor classes (tokenizer trained here, processor saved beside the weights).

A stable user API: a toy checkpoint for trying mmkit, writing a test or a benchmark, with
nothing downloaded:

    from mmkit.testing import build_tiny_checkpoint
    path = build_tiny_checkpoint("Qwen2VLForConditionalGeneration", "/tmp/tiny-qwen")

One module per family (`mmkit/testing/<family>.py`); `build_tiny_checkpoint` dispatches on the
architecture name, and each family module's builder takes its own keyword options.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from mmkit.testing.llava import (CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_llava, build_tokenizer,
                                 hub_key, rewrite_hub_layout, tiny_text_config, tiny_vision)

__all__ = ["build_tiny_checkpoint", "tiny_architectures", "build_tiny_llava", "build_tiny_anyres",
           "build_tiny_qwen2_vl", "rewrite_hub_layout", "rewrite_qwen_hub_layout", "hub_key",
           "build_tokenizer", "tiny_text_config", "tiny_vision", "CHAT_TEMPLATE", "SPECIAL_TOKENS"]

# architecture -> (module under mmkit.testing, builder, default keyword arguments)
_BUILDERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "LlavaForConditionalGeneration": ("llava", "build_tiny_llava", {}),
    "LlavaNextForConditionalGeneration": ("llava_next", "build_tiny_anyres", {"family": "llava_next"}),
    # OneVision's real checkpoints: Qwen2 decoder, SigLIP tower, every feature row, tied embeddings.
    "LlavaOnevisionForConditionalGeneration": ("llava_next", "build_tiny_anyres", {
        "family": "llava_onevision", "text_type": "qwen2", "vision_type": "siglip", "select_strategy": "full",
        "vision_feature_layer": -1, "tie_word_embeddings": True}),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "build_tiny_qwen2_vl", {"version": "2"}),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "build_tiny_qwen2_vl", {"version": "2.5"}),
    "Mistral3ForConditionalGeneration": ("mistral3", "build_tiny_mistral3", {}),
    "Idefics3ForConditionalGeneration": ("idefics3", "build_tiny_idefics3", {"family": "idefics3"}),
    "SmolVLMForConditionalGeneration": ("idefics3", "build_tiny_idefics3", {"family": "smolvlm"}),
    "Gemma3ForConditionalGeneration": ("gemma3", "build_tiny_gemma3", {}),
    "InternVLForConditionalGeneration": ("internvl", "build_tiny_internvl", {}),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "build_tiny_qwen3_vl", {"moe": False}),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "build_tiny_qwen3_vl", {"moe": True}),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "build_tiny_qwen3_5", {"moe": False}),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "build_tiny_qwen3_5", {"moe": True}),
    "Lfm2VlForConditionalGeneration": ("lfm2_vl", "build_tiny_lfm2_vl", {}),
}


def tiny_architectures() -> list[str]:
    """The architectures `build_tiny_checkpoint` can build."""
    return sorted(_BUILDERS)


def build_tiny_checkpoint(architecture: str, out_dir: str | Path, *, text_tie_word_embeddings: bool | None = None,
                          **kwargs: Any) -> Path:
    """Save a tiny random checkpoint of `architecture` (HF `architectures[0]`) into `out_dir`
    and return its path; `kwargs` go to the family's builder (seed, layer counts, ...).
    `text_tie_word_embeddings` then writes that flag into the saved `text_config` whatever the
    top-level one says: the two levels set differently, as checkpoints in the wild have them
    (transformers reads the top level; some config classes copy a true text flag up)."""
    if architecture not in _BUILDERS:
        raise ValueError(f"architecture {architecture!r} has no tiny builder; available: "
                         f"{tiny_architectures()}")
    module, builder, defaults = _BUILDERS[architecture]
    fn = getattr(importlib.import_module(f"mmkit.testing.{module}"), builder)
    path = fn(out_dir, **{**defaults, **kwargs})
    if text_tie_word_embeddings is not None:
        config_file = Path(path) / "config.json"
        config = json.loads(config_file.read_text())
        config.setdefault("text_config", {})["tie_word_embeddings"] = text_tie_word_embeddings
        config_file.write_text(json.dumps(config, indent=2))
    return path


def __getattr__(name: str) -> Any:
    # The other families' builders load lazily (importing this package stays cheap).
    lazy = {"build_tiny_anyres": "llava_next", "PINPOINTS": "llava_next",
            "build_tiny_qwen2_vl": "qwen2_vl", "rewrite_qwen_hub_layout": "qwen2_vl",
            "build_qwen_tokenizer": "qwen2_vl", "build_tiny_mistral3": "mistral3",
            "rewrite_mistral3_hub_layout": "mistral3", "build_tiny_idefics3": "idefics3",
            "rewrite_idefics3_hub_layout": "idefics3", "build_tiny_gemma3": "gemma3",
            "rewrite_gemma3_hub_layout": "gemma3"}
    if name in lazy:
        return getattr(importlib.import_module(f"mmkit.testing.{lazy[name]}"), name)
    raise AttributeError(f"module 'mmkit.testing' has no attribute {name!r}")
