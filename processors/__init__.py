"""Input pipeline (installed as `mmkit.processors`): HF processor -> token ids, placeholder
ranges and, at scheduling time, each item's model inputs."""

from __future__ import annotations

from mmkit.processors.base import InputProcessor, ProcessedPrompt
from mmkit.processors.llava import LlavaInputProcessor

__all__ = ["InputProcessor", "ProcessedPrompt", "LlavaInputProcessor", "get_input_processor"]


def get_input_processor(model_config, tokenizer_path: str, limit_mm_per_prompt,
                        mm_processor_kwargs=None) -> InputProcessor:
    """The registered processor of `model_config.architecture` (mmkit.models.registry)."""
    from mmkit.models.registry import ModelRegistry

    cls = ModelRegistry.resolve(model_config.architecture, getattr(model_config, "model_impl", "mmkit"))[1]
    return cls(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
