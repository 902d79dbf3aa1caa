"""Input pipeline (installed as `mmkit.processors`): HF processor -> token ids, placeholder
ranges and, at scheduling time, each item's model inputs."""

from __future__ import annotations

import importlib

from mmkit.processors.base import InputProcessor, ProcessedPrompt
from mmkit.processors.llava import LlavaInputProcessor

__all__ = ["InputProcessor", "ProcessedPrompt", "LlavaInputProcessor", "get_input_processor"]

# HF `architectures[0]` -> (module, class) of its input processor; one module per family.
_PROCESSORS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("mmkit.processors.llava", "LlavaInputProcessor"),
    "LlavaNextForConditionalGeneration": ("mmkit.processors.llava_next", "LlavaNextInputProcessor"),
    "LlavaOnevisionForConditionalGeneration": ("mmkit.processors.llava_next", "LlavaOnevisionInputProcessor"),
    "Qwen2VLForConditionalGeneration": ("mmkit.processors.qwen2_vl", "Qwen2VLInputProcessor"),
    "Qwen2_5_VLForConditionalGeneration": ("mmkit.processors.qwen2_vl", "Qwen2VLInputProcessor"),
    "Qwen3VLForConditionalGeneration": ("mmkit.processors.qwen3_vl", "Qwen3VLInputProcessor"),
    "Qwen3VLMoeForConditionalGeneration": ("mmkit.processors.qwen3_vl", "Qwen3VLInputProcessor"),
}


def get_input_processor(model_config, tokenizer_path: str, limit_mm_per_prompt,
                        mm_processor_kwargs=None) -> InputProcessor:
    module_name, class_name = _PROCESSORS[model_config.architecture]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
