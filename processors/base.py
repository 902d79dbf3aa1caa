"""The typed result of input processing, carried by a request from `add_request` to the
runner, and what a family's input processor provides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from mmkit.multimodal.items import MultiModalItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange


@dataclass
class ProcessedPrompt:
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    # One range per item, in item order: the positions its embedding rows replace.
    placeholder_ranges: list[PlaceholderRange] = field(default_factory=list)
    # Every item (images, videos, spans) in placeholder order; the family builds them.
    images: list[MultiModalItem] = field(default_factory=list)
    # Embeddings given by the user, one [num_tokens_i, hidden] per item (a [N, L, hidden]
    # tensor is N items, or a list); they skip the vision tower. In a list, a None entry is an
    # item of `images` that mmkit encodes (a video beside given image embeddings).
    image_embeds: torch.Tensor | list[torch.Tensor | None] | None = None
    # M-RoPE models only (see mmkit.models.interfaces.SupportsMRoPE): [3, num_prompt_tokens]
    # positions and the offset of generated tokens (position = index + delta).
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    # Processor options of this request (engine-wide ones merged with its own); part of its
    # items' content hashes, so other options never share cached embeddings or KV blocks.
    mm_processor_kwargs: dict = field(default_factory=dict)
    # Spans the decoder attends bidirectionally (Gemma 3: each run of image soft tokens), as
    # (offset, length); the scheduler computes each in one chunk, the attention reads them.
    bidirectional_ranges: list[PlaceholderRange] = field(default_factory=list)
    # The request's LoRA adapter (mmkit.lora.LoRARequest) or None; set by the engine.
    lora_request: Any = None


class InputProcessor(Protocol):
    """What the engine calls on a family's processor (`processors/<family>.py`).

    Built as `cls(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)`;
    the constructor checks the engine-wide `mm_processor_kwargs` (ValueError naming the key and
    what the family accepts) and `process` checks a request's own, so generic code never knows
    a family's options."""

    # The modalities `process` accepts ("image", "video"); chat parsing reads it.
    supported_modalities: ClassVar[tuple[str, ...]]
    tokenizer: Any
    hf_processor: Any
    chat_template: str | None

    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        """Cheap and up front (every prompt of a call is validated before any is added):
        token ids with placeholders expanded, placeholder ranges, M-RoPE positions."""
        ...

    def mm_item_inputs(self, item: MultiModalItem) -> MultiModalKwargs:
        """The item's model inputs for `embed_multimodal`: run by the input stage
        (`mmkit/multimodal/stage.py`) on a prefetch worker while the request waits. A failure
        here fails that request alone."""
        ...
