"""Input pipeline (installed as `mmkit.processors`): HF processor -> token ids, placeholder
ranges and, at scheduling time, pixel values."""

from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.llava import LlavaInputProcessor

__all__ = ["ProcessedPrompt", "LlavaInputProcessor", "get_input_processor"]


def get_input_processor(model_config, tokenizer_path: str, limit_mm_per_prompt):
    # Only LLaVA today; one module per model family as more arrive.
    return LlavaInputProcessor(model_config, tokenizer_path, limit_mm_per_prompt)
