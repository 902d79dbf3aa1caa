"""Qwen3.5 (dense and MoE): the checkpoint's processor is transformers' `Qwen3VLProcessor`
(Qwen2-VL image processor, Qwen3-VL video processor with timestamps), so the input pipeline is
Qwen3-VL's (processors/qwen3_vl.py): the same spans, video frame runs and M-RoPE rows (a video
is split per frame, as Qwen3.5's `get_rope_index` splits its grid). The tower has no DeepStack,
so given image embeddings are `[num_tokens, hidden_size]`."""

from __future__ import annotations

from mmkit.processors.qwen3_vl import Qwen3VLInputProcessor


class Qwen3_5InputProcessor(Qwen3VLInputProcessor):
    pass
