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
}


def get_input_processor(model_config, tokenizer_path: str, limit_mm_per_prompt) -> InputProcessor:
    module_name, class_name = _PROCESSORS[model_config.architecture]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(model_config, tokenizer_path, limit_mm_per_prompt)
