"""The typed result of input processing, carried by a request from `add_request` to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmkit.inputs import ImageItem


@dataclass
class ProcessedPrompt:
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    # (offset, length) of each image's placeholder run in prompt_token_ids, in image order.
    placeholder_ranges: list[tuple[int, int]] = field(default_factory=list)
    images: list[ImageItem] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None  # [N, image_seq_length, hidden] given by the user
    # Families with variable-size items (Qwen2-VL): one item per placeholder range, in prompt
    # order (processors/qwen2_vl.py's VisionItem), the M-RoPE rows [3, num_prompt_tokens] and
    # the position offset of generated tokens (transformers' rope_deltas).
    mm_items: list = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    mm_processor_kwargs: dict = field(default_factory=dict)

    @property
    def num_images(self) -> int:
        return len(self.placeholder_ranges)

    @property
    def has_images(self) -> bool:
        return bool(self.placeholder_ranges)
