"""Input pipeline (installed as `mmkit.processors`): HF processor -> token ids, placeholder
ranges and, at scheduling time, pixel values."""

from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.llava import LlavaInputProcessor

__all__ = ["ProcessedPrompt", "LlavaInputProcessor", "get_input_processor"]


def get_input_processor(model_config, tokenizer_path: str, limit_mm_per_prompt, mm_processor_kwargs=None):
    """The family's input processor (one module per model family)."""
    if model_config.architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        from mmkit.processors.qwen2_vl import Qwen2VLInputProcessor

        return Qwen2VLInputProcessor(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
    return LlavaInputProcessor(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
