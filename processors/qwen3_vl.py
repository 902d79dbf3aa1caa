"""Qwen3-VL / Qwen3-VL-MoE input processing with the checkpoint's own HF processor.

Images are Qwen2-VL's (the same image processor; see processors/qwen2_vl.py). Videos follow
transformers' Qwen3-VL video processor: frames are sampled with its own `sample_frames` (a list
of frames has no metadata, so the clip is taken at transformers' default 24 fps, and
`mm_processor_kwargs["fps"]` is the sampling rate, default the processor's `fps`), resized for
the sampled count, and the placeholder becomes, per temporal patch, `<{t:.1f} seconds>`
`<|vision_start|>` frame tokens `<|vision_end|>` with the processor's own timestamps. That whole
expansion is the video's placeholder range (the model embeds its text tokens itself); its
M-RoPE positions are transformers' `get_rope_index`: one (1, h, w) grid per temporal patch,
text (timestamps) between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange
from mmkit.models.mrope import MRopeItem
from mmkit.processors.qwen2_vl import Qwen2VLInputProcessor, VisionItem

_CLIP_FPS_WITHOUT_METADATA = 24  # transformers' assumption for frames given without metadata


@dataclass
class VideoSpan:
    """A sampled video's expansion: token ids of the whole range, which rows are frame tokens."""

    token_ids: list[int]
    vision_rows: list[bool]
    frame_offsets: list[int] = field(default_factory=list)  # first frame token of each temporal patch


@dataclass
class VideoItem(VisionItem):
    """A sampled video (`frames` are the sampled ones) and its expansion."""

    span: VideoSpan | None = None


class Qwen3VLInputProcessor(Qwen2VLInputProcessor):
    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt, mm_processor_kwargs=None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        self.tokens_per_second = None  # Qwen3-VL has no temporal scale: timestamps are text
        self.vision_start_id = model_config.hf_config.vision_start_token_id
        self.vision_end_id = model_config.hf_config.vision_end_token_id
        self.deepstack_layers = len(model_config.hf_config.vision_config.deepstack_visual_indexes)

    def _vision_item(self, where: str, modality: str, frames: Any, kwargs: dict) -> VisionItem:
        if modality == "image":
            return super()._vision_item(where, modality, frames, kwargs)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        from transformers.video_utils import VideoMetadata

        proc = self.video_processor
        frames = frames if isinstance(frames, list) else [frames]
        metadata = VideoMetadata(total_num_frames=len(frames), fps=None)
        indices = [int(i) for i in proc.sample_frames(metadata, fps=kwargs.get("fps", proc.fps))]
        sampled = [frames[i] for i in indices]
        size = dict(proc.size)
        min_pixels = kwargs.get("min_pixels", size.get("shortest_edge"))
        max_pixels = kwargs.get("max_pixels", size.get("longest_edge"))
        patch, merge, temporal = proc.patch_size, proc.merge_size, proc.temporal_patch_size
        if getattr(proc, "cap_pixels_per_frame", False):  # transformers' per-frame cap
            cap = proc.max_video_tokens * (patch * merge) ** 2
            max_pixels = max(min(cap, max_pixels // len(sampled)), int(min_pixels * 1.05)) * len(sampled)
        width, height = sampled[0].width, sampled[0].height
        try:
            rh, rw = smart_resize(len(sampled), height, width, temporal_factor=temporal, factor=patch * merge,
                                  min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as exc:
            raise ValueError(f"{where}: got a {len(frames)}-frame {width}x{height} video ({len(sampled)} sampled): "
                             f"{exc}") from None
        t = -(-len(sampled) // temporal)
        grid = (t, rh // patch, rw // patch)
        frame_tokens = grid[1] * grid[2] // merge ** 2
        stamps = self.hf_processor._calculate_timestamps(indices, _CLIP_FPS_WITHOUT_METADATA, temporal)
        span = VideoSpan([], [])
        for stamp in stamps:
            text = self.tokenizer(f"<{stamp:.1f} seconds>", add_special_tokens=False).input_ids
            span.token_ids += text + [self.vision_start_id]
            span.frame_offsets.append(len(span.token_ids))
            span.token_ids += [self.token_ids["video"]] * frame_tokens + [self.vision_end_id]
        span.vision_rows = [tid == self.token_ids["video"] for tid in span.token_ids]
        return VideoItem("video", sampled, grid, len(span.token_ids), dict(kwargs), span=span)

    def _placeholder_ids(self, item: VisionItem) -> list[int]:
        span = getattr(item, "span", None)
        return list(span.token_ids) if span is not None else super()._placeholder_ids(item)

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
        size_kwargs = {}
        if "min_pixels" in item.processor_kwargs or "max_pixels" in item.processor_kwargs:
            size = dict(self.video_processor.size)
            size["shortest_edge"] = item.processor_kwargs.get("min_pixels", size["shortest_edge"])
            size["longest_edge"] = item.processor_kwargs.get("max_pixels", size["longest_edge"])
            size_kwargs["size"] = size
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        out = self.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt", **size_kwargs)
        grid = out["video_grid_thw"]
        if tuple(grid[0].tolist()) != item.grid_thw:
            raise ValueError(f"{item.frames[0].where}: the processor produced a {tuple(grid[0].tolist())} patch grid "
                             f"where {item.grid_thw} was predicted; refusing to misalign the placeholders")
        return {"pixel_values": out["pixel_values_videos"], "grid_thw": grid,
                "span_token_ids": torch.tensor(span.token_ids, dtype=torch.long),
                "span_vision": torch.tensor(span.vision_rows, dtype=torch.bool)}
