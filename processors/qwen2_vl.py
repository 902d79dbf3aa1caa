"""Qwen2-VL / Qwen2.5-VL input processing with the checkpoint's own HF processor.

Up front (cheap, for the whole call before anything is added): tokenize, predict each item's
patch grid with the image processor's own `smart_resize` (dynamic resolution bounded by
min/max_pixels), expand every `<|image_pad|>` / `<|video_pad|>` to t*h*w / merge^2 tokens,
record the placeholder ranges and compute the M-RoPE positions. At scheduling time the HF
image / video processor turns one item into `pixel_values [num_patches, C*T*P*P]` and its
`grid_thw`, which must equal the prediction (checked: never a silent misalignment).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange
from mmkit.models.mrope import MRopeItem, mrope_positions
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.mm_kwargs import POSITIVE_INT, POSITIVE_NUMBER, check_min_le_max
from mmkit.processors.mm_kwargs import check_mm_processor_kwargs as check_options
from mmkit.multimodal.video import parse_videos
from mmkit.processors.qwen_embeds import GivenEmbedsItem, given_image_items

# Per-request processor options (vLLM's `mm_processor_kwargs`) mmkit passes to the HF processor.
ALLOWED_MM_PROCESSOR_KWARGS = {"min_pixels": POSITIVE_INT, "max_pixels": POSITIVE_INT, "fps": POSITIVE_NUMBER}
_MODALITY_TYPE = {"image": 1, "video": 2}  # transformers' mm_token_type_ids values


@dataclass
class VisionItem:
    """One image or video of a prompt, validated; pixels are processed only when scheduled."""

    modality: str  # "image" | "video"
    frames: list[ImageItem]  # one frame for an image
    grid_thw: tuple[int, int, int]  # patch grid the HF processor will produce (before the 2x2 merge)
    num_tokens: int  # placeholder tokens: t * h * w / merge^2
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # effective mm_processor_kwargs
    time_interval: float = 1.0  # M-RoPE temporal step
    _hash: str | None = None

    @property
    def processor_options(self) -> dict[str, Any]:
        return self.processor_kwargs

    @property
    def layout(self) -> str:
        return ""  # one layout: the grid follows from the size and the options

    def content_hash(self) -> str:
        """SHA-256 over the modality, the processor options and every frame's pixels: the same
        image at two max_pixels settings never shares cached embeddings or KV blocks."""
        if self._hash is None:
            h = hashlib.sha256()
            h.update(f"{self.modality}:{json.dumps(self.processor_kwargs, sort_keys=True)}:".encode())
            for frame in self.frames:
                img = frame.to_pil()
                h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
                h.update(img.tobytes())
            self._hash = h.hexdigest()
        return self._hash


def check_mm_processor_kwargs(where: str, kwargs: Any) -> dict[str, Any]:
    checked = check_options(where, kwargs, ALLOWED_MM_PROCESSOR_KWARGS, "{'max_pixels': 200704}")
    check_min_le_max(where, checked, "min_pixels", "max_pixels")
    return checked


class Qwen2VLInputProcessor:
    """Tokens, placeholder ranges, M-RoPE positions and per-item pixels for Qwen2(.5)-VL."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = model_config.hf_config
        self.model_config = model_config
        self.hf_processor = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_processor = self.hf_processor.image_processor
        self.video_processor = getattr(self.hf_processor, "video_processor", None)
        self.chat_template = getattr(self.hf_processor, "chat_template", None)
        self.vocab_size = model_config.vocab_size
        self.token_ids = {"image": hf.image_token_id, "video": hf.video_token_id}
        self.token_names = {"image": self.hf_processor.image_token, "video": self.hf_processor.video_token}
        self.merge_size = hf.vision_config.spatial_merge_size
        self.tokens_per_second = getattr(hf.vision_config, "tokens_per_second", None)  # Qwen2.5-VL only
        self.max_items = {m: int(limit_mm_per_prompt.get(m, 8 if m == "image" else 1)) for m in ("image", "video")}
        self.default_kwargs = check_mm_processor_kwargs("mm_processor_kwargs", mm_processor_kwargs)
        self.deepstack_layers = 0  # Qwen3-VL: DeepStack feature sets carried beside given image embeddings

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        kwargs = {**self.default_kwargs,
                  **check_mm_processor_kwargs(f"{where}.mm_processor_kwargs", parsed.mm_processor_kwargs)}
        videos = [] if parsed.video_data is None else parse_videos(f"{where}.multi_modal_data['video']",
                                                                    parsed.video_data)
        given = {"image": list(parsed.images), "video": videos}
        if parsed.image_embeds is not None:  # processors/qwen_embeds.py: the layout and its checks
            given["image"] = given_image_items(where, parsed, self.merge_size, self.model_config.hidden_size,
                                               self.deepstack_layers)
        for modality, items in given.items():
            if len(items) > self.max_items[modality]:
                raise ValueError(f"{where}.multi_modal_data: got {len(items)} {modality}s; expected at most "
                                 f"limit_mm_per_prompt['{modality}'] = {self.max_items[modality]}")
        if parsed.prompt is not None:
            ids = list(self.tokenizer(parsed.prompt).input_ids)
        else:
            ids = list(parsed.prompt_token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{where}.prompt_token_ids: got token id {bad[0]}; expected ids in "
                                 f"[0, {self.vocab_size})")
        vision = {m: [item if isinstance(item, GivenEmbedsItem)
                      else self._vision_item(f"{where}.multi_modal_data.{m}[{i}]", m, item, kwargs)
                      for i, item in enumerate(items)] for m, items in given.items()}
        ids, ranges, ordered = self._expand(where, ids, vision, allow_expanded=parsed.prompt is None)
        positions, delta = mrope_positions(len(ids), self._mrope_items(ranges, ordered))
        self._check_positions(where, positions, delta, kwargs)
        # NOTE: `images` holds every item (images and videos) in placeholder order: the
        # scheduler pairs item i with range i and hashes it with `VisionItem.content_hash`.
        # Given embeddings: one entry per item, None for an item mmkit encodes (a video).
        embeds = None if parsed.image_embeds is None else [getattr(item, "embeds", None) for item in ordered]
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=ids,
                               placeholder_ranges=ranges, images=ordered, image_embeds=embeds,
                               mrope_positions=positions, mrope_position_delta=delta, mm_processor_kwargs=kwargs)

    def _check_positions(self, where: str, positions: torch.Tensor, delta: int, kwargs: dict) -> None:
        """M-RoPE positions index the decoder's rotary table (2 x max positions, see
        models/qwen2_vl.py): only a tiny `fps` (wide temporal spacing) can run past it."""
        mc = self.model_config
        text = mc.hf_config.get_text_config()
        limit = 2 * max(mc.max_model_len, getattr(text, "max_position_embeddings", 0) or 0)
        highest = max(int(positions.max()) if positions.numel() else 0, mc.max_model_len - 1 + delta)
        if highest >= limit:
            raise ValueError(f"{where}: M-RoPE positions reach {highest} (mm_processor_kwargs={kwargs}); expected "
                             f"below {limit}: use a larger fps or fewer frames")

    def _mrope_items(self, ranges: list[PlaceholderRange], ordered: list[VisionItem]) -> list[MRopeItem]:
        return [MRopeItem(off, n, self._merged_grid(item), item.time_interval) for (off, n), item in zip(ranges, ordered)]

    def _placeholder_ids(self, item: VisionItem) -> list[int]:
        """The tokens one item's placeholder becomes (its range in the prompt)."""
        return [self.token_ids[item.modality]] * item.num_tokens

    def _merged_grid(self, item: VisionItem) -> tuple[int, int, int]:
        t, h, w = item.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    def _vision_item(self, where: str, modality: str, frames: Any, kwargs: dict) -> VisionItem:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        frames = frames if isinstance(frames, list) else [frames]
        proc = self.image_processor if modality == "image" else self.video_processor
        if proc is None:
            raise ValueError(f"{where}: this checkpoint's processor has no video processor")
        size = dict(proc.size)
        min_pixels = kwargs.get("min_pixels", size.get("shortest_edge"))
        max_pixels = kwargs.get("max_pixels", size.get("longest_edge"))
        patch, merge, temporal = proc.patch_size, proc.merge_size, proc.temporal_patch_size
        width, height = frames[0].width, frames[0].height
        try:
            rh, rw = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as exc:  # aspect ratio over 200
            raise ValueError(f"{where}: got a {width}x{height} {modality}: {exc}") from None
        # An image is one temporal patch (the processor repeats it); a video's frames are padded
        # to a multiple of temporal_patch_size by repeating the last one, as transformers does.
        t = 1 if modality == "image" else -(-len(frames) // temporal)
        grid = (t, rh // patch, rw // patch)
        interval = 1.0
        if modality == "video" and self.tokens_per_second is not None:
            fps = kwargs.get("fps", 24.0)  # transformers' sampled_fps for frames without metadata
            interval = self.tokens_per_second * temporal / fps
        used = {k: v for k, v in kwargs.items() if k != "fps" or modality == "video"}
        return VisionItem(modality, frames, grid, t * grid[1] * grid[2] // merge ** 2, used, interval)

    def _expand(self, where: str, ids: list[int], vision: dict[str, list[VisionItem]], allow_expanded: bool):
        """Expand each placeholder token to its item's token count; items in prompt order."""
        token_to_modality = {tid: m for m, tid in self.token_ids.items()}
        queues = {m: list(items) for m, items in vision.items()}
        out: list[int] = []
        ranges: list[tuple[int, int]] = []
        ordered: list[VisionItem] = []
        i = 0
        while i < len(ids):
            modality = token_to_modality.get(ids[i])
            if modality is None:
                out.append(ids[i])
                i += 1
                continue
            run = 1
            while i + run < len(ids) and ids[i + run] == ids[i]:
                run += 1
            queue = queues[modality]
            if not queue:
                raise ValueError(self._count_error(where, ids, vision))
            n = queue[0].num_tokens
            if run != 1 and not (allow_expanded and run == n):
                raise ValueError(f"{where}: a run of {run} {self.token_names[modality]} tokens (id {ids[i]}); "
                                 f"expected one per {modality}, each inside <|vision_start|>...<|vision_end|>"
                                 + (f", or exactly {n} (this {modality}'s token count)" if allow_expanded else ""))
            item = queue.pop(0)
            ranges.append(PlaceholderRange(len(out), item.num_tokens))
            ordered.append(item)
            out.extend(self._placeholder_ids(item))
            i += run
        if any(queues.values()):
            raise ValueError(self._count_error(where, ids, vision))
        return out, ranges, ordered

    def _count_error(self, where: str, ids: list[int], vision: dict[str, list[VisionItem]]) -> str:
        parts = []
        for modality, items in vision.items():
            tid = self.token_ids[modality]
            runs = sum(1 for j, t in enumerate(ids) if t == tid and (j == 0 or ids[j - 1] != tid))
            parts.append(f"{runs} {self.token_names[modality]} placeholder(s) for {len(items)} {modality}(s)")
        return f"{where}: the prompt has " + " and ".join(parts) + "; expected one placeholder per item"

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: VisionItem) -> MultiModalKwargs:
        """One item -> {"pixel_values": [num_patches, C*T*P*P], "grid_thw": [1, 3]} via the HF
        image or video processor (the model's `embed_multimodal` input)."""
        size_kwargs = {}
        if "min_pixels" in item.processor_kwargs or "max_pixels" in item.processor_kwargs:
            proc = self.image_processor if item.modality == "image" else self.video_processor
            size = dict(proc.size)
            size["shortest_edge"] = item.processor_kwargs.get("min_pixels", size["shortest_edge"])
            size["longest_edge"] = item.processor_kwargs.get("max_pixels", size["longest_edge"])
            size_kwargs["size"] = size
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        if item.modality == "image":
            out = self.image_processor(images=frames, return_tensors="pt", **size_kwargs)
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        else:
            out = self.video_processor(videos=[frames], return_tensors="pt", **size_kwargs)
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        if tuple(grid[0].tolist()) != item.grid_thw:
            raise ValueError(f"{item.frames[0].where}: the processor produced a {tuple(grid[0].tolist())} patch grid "
                             f"where {item.grid_thw} was predicted; refusing to misalign the placeholders")
        return {"pixel_values": pixels, "grid_thw": grid}

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(token_ids, **kwargs)
