"""Qwen3-VL / Qwen3-VL-MoE input processing with the checkpoint's own HF processor.

Images are Qwen2-VL's (the same image processor; see processors/qwen2_vl.py). A video is given
to the processor whole, with its options (`mm_processor_kwargs["fps"]` is the sampling rate,
default the processor's own `fps`): the processor samples the frames (a list of frames has no
metadata; transformers takes it at 24 fps), resizes them and writes the placeholder, per temporal
patch `<{t:.1f} seconds><|vision_start|>` frame tokens `<|vision_end|>`. Up front that text comes
from the processor on blank frames of the same size and count (`processors/replacements.py`);
when the video is scheduled the same call on the real frames must write it again. The whole
replacement is the video's placeholder range (the model embeds its text tokens itself:
`span_token_ids`, `span_vision`); its M-RoPE positions are transformers' `get_rope_index`: one
(1, h, w) grid per run of video tokens, text (timestamps) between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from mmkit.models.mrope import MRopeItem
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.processors.qwen2_vl import Qwen2VLInputProcessor, VisionItem
from mmkit.processors.replacements import Replacement, check_feature_rows


@dataclass
class VideoSpan:
    """A video's expansion as the processor writes it: token ids of the whole range, which rows
    are frame tokens, and where each run of frame tokens (one temporal patch) starts."""

    token_ids: list[int]
    vision_rows: list[bool]
    frame_offsets: list[int] = field(default_factory=list)


@dataclass
class VideoItem(VisionItem):
    """A video (`frames` are every given frame; the processor samples them) and its expansion."""

    span: VideoSpan | None = None


class Qwen3VLInputProcessor(Qwen2VLInputProcessor):
    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt, mm_processor_kwargs=None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        self.tokens_per_second = None  # Qwen3-VL has no temporal scale: timestamps are text
        # Qwen3.5's tower has no DeepStack (its config has no deepstack_visual_indexes)
        self.deepstack_layers = len(getattr(model_config.hf_config.vision_config, "deepstack_visual_indexes", None) or ())

    def _item(self, where: str, modality: str, given: Any, rep: Replacement, ids: list[int],
              rng: PlaceholderRange, kwargs: Mapping[str, Any]) -> tuple[Any, PlaceholderRange]:
        if modality == "image":
            return super()._item(where, modality, given, rep, ids, rng, kwargs)
        grid = tuple(int(x) for x in rep.outputs["video_grid_thw"])
        t, h, w = grid
        frame_tokens = h * w // self.merge_size ** 2
        span_ids = ids[rng.offset:rng.offset + rng.length]
        video_id = self.token_ids["video"]
        vision_rows = [tid == video_id for tid in span_ids]
        offsets = [k for k, is_video in enumerate(vision_rows) if is_video and (k == 0 or not vision_rows[k - 1])]
        runs = [next((j for j in range(k, len(span_ids)) if not vision_rows[j]), len(span_ids)) - k for k in offsets]
        check_feature_rows(where, f"a video with patch grid {grid}", sum(vision_rows), t * frame_tokens)
        if len(runs) != t or any(n != frame_tokens for n in runs):
            raise ValueError(f"{where}: the processor wrote video frame runs of {runs} tokens; the model expects "
                             f"{t} runs of {frame_tokens} (patch grid {grid})")
        span = VideoSpan(list(span_ids), vision_rows, offsets)
        options = self.item_options(modality, kwargs)
        return VideoItem("video", list(given), grid, rng.length, options, 1.0, rep.text, where, span=span), rng

    def _mrope_items(self, ranges: list[PlaceholderRange], ordered: list[VisionItem]) -> list[MRopeItem]:
        out = []
        for (offset, length), item in zip(ranges, ordered):
            _, h, w = self._merged_grid(item)
            span = getattr(item, "span", None)
            if span is None:
                out.append(MRopeItem(offset, length, self._merged_grid(item)))
                continue
            out.extend(MRopeItem(offset + start, h * w, (1, h, w)) for start in span.frame_offsets)
        return out

    def mm_item_inputs(self, item: VisionItem) -> MultiModalKwargs:
        span = getattr(item, "span", None)
        if span is None:
            return super().mm_item_inputs(item)
        _, out = self.processor_outputs(item)
        return {"pixel_values": out["pixel_values_videos"], "grid_thw": out["video_grid_thw"],
                "span_token_ids": torch.tensor(span.token_ids, dtype=torch.long),
                "span_vision": torch.tensor(span.vision_rows, dtype=torch.bool)}
