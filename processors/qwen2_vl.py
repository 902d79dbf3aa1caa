"""Qwen2-VL / Qwen2.5-VL input processing with the checkpoint's own HF processor.

Up front (cheap, for the whole call before anything is added): what the processor writes for
each image / video at its size, frame count and options (`processors/replacements.py`: a blank
item of that size through the processor itself, cached), with the patch grid it reports
(`image_grid_thw` / `video_grid_thw`); the prompt is expanded by the processor's own
`get_text_with_replacements`. An item's placeholder range is its run of `<|image_pad|>` /
`<|video_pad|>` tokens (checked against the model's t*h*w / merge^2 rows for that grid), and the
M-RoPE positions follow from the grid. Options (`min_pixels`, `max_pixels`, `fps`) go into the
processor call as its own `size` / `fps` arguments. At scheduling time the same processor call
on the item's pixels gives `pixel_values [num_patches, C*T*P*P]` and its `grid_thw`, and must
write the same text (checked: never a silent misalignment).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from mmkit.models.mrope import MRopeItem, mrope_positions
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.multimodal.video import parse_videos
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.mm_kwargs import POSITIVE_INT, POSITIVE_NUMBER, check_min_le_max
from mmkit.processors.qwen_embeds import GivenEmbedsItem, given_image_items
from mmkit.processors.replacements import (Replacement, ReplacementProbe, call_processor, check_feature_rows,
                                           check_placeholder_counts, expand_text, expand_token_ids, feature_run)
from mmkit.processors.spans import checked_token_ids

# Per-request processor options (vLLM's `mm_processor_kwargs`) mmkit passes to the HF processor.
ALLOWED_MM_PROCESSOR_KWARGS = {"min_pixels": POSITIVE_INT, "max_pixels": POSITIVE_INT, "fps": POSITIVE_NUMBER}
_CLIP_FPS_WITHOUT_METADATA = 24.0  # transformers' frame rate for frames given without metadata


@dataclass
class VisionItem:
    """One image or video of a prompt, validated; pixels are processed only when scheduled."""

    modality: str  # "image" | "video"
    frames: list[ImageItem]  # one frame for an image; every given frame of a video
    grid_thw: tuple[int, int, int]  # patch grid the HF processor reports (before the 2x2 merge)
    num_tokens: int  # tokens of the item's placeholder range
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # effective mm_processor_kwargs
    time_interval: float = 1.0  # M-RoPE temporal step
    replacement: str = ""  # what the processor writes for the item (the same call must write it again)
    where: str = ""  # e.g. "inputs[0].multi_modal_data.image[1]", for error messages
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


class Qwen2VLInputProcessor(BaseInputProcessor):
    """Tokens, placeholder ranges, M-RoPE positions and per-item pixels for Qwen2(.5)-VL."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")
    mm_processor_rules = ALLOWED_MM_PROCESSOR_KWARGS
    mm_processor_example = "{'max_pixels': 200704}"

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        hf = model_config.hf_config
        self.load_hf_processor(tokenizer_path)
        self.token_ids = {"image": hf.image_token_id, "video": hf.video_token_id}
        self.token_names = {"image": self.hf_processor.image_token, "video": self.hf_processor.video_token}
        self.merge_size = hf.vision_config.spatial_merge_size
        self.tokens_per_second = getattr(hf.vision_config, "tokens_per_second", None)  # Qwen2.5-VL only
        self.deepstack_layers = 0  # Qwen3-VL: DeepStack feature sets carried beside given image embeddings
        self.probe = ReplacementProbe(self.hf_processor)

    def check_mm_processor_kwargs(self, where: str, kwargs: Any) -> dict[str, Any]:
        checked = super().check_mm_processor_kwargs(where, kwargs)
        check_min_le_max(where, checked, "min_pixels", "max_pixels")
        return checked

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        kwargs = self.request_options(where, parsed)
        videos = [] if parsed.video_data is None else parse_videos(f"{where}.multi_modal_data['video']",
                                                                    parsed.video_data)
        given = {"image": list(parsed.images), "video": videos}
        if parsed.image_embeds is not None:  # processors/qwen_embeds.py: the layout and its checks
            given["image"] = given_image_items(where, parsed, self.merge_size, self.model_config.hidden_size,
                                               self.deepstack_layers)
        self.check_item_counts(where, {m: len(items) for m, items in given.items()})
        wheres = {m: [f"{where}.multi_modal_data.{m}[{i}]" for i in range(len(items))] for m, items in given.items()}
        reps = {m: [self._replacement(at, m, item, kwargs) for at, item in zip(wheres[m], items)]
                for m, items in given.items()}
        if parsed.prompt is not None:
            self._check_counts(where, {m: parsed.prompt.count(self.token_names[m]) for m in given}, given)
            exp = expand_text(self.hf_processor, self.tokenizer, where, parsed.prompt, reps)
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            exp = expand_token_ids(self.hf_processor, self.tokenizer, where, ids, reps)
        ranges: list[PlaceholderRange] = []
        ordered: list[VisionItem | GivenEmbedsItem] = []
        for (modality, k), rng in zip(exp.order, exp.ranges):
            item, rng = self._item(wheres[modality][k], modality, given[modality][k], reps[modality][k],
                                   exp.token_ids, rng, kwargs)
            ranges.append(rng)
            ordered.append(item)
        ids = exp.token_ids
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

    def _check_counts(self, where: str, found: Mapping[str, int], given: Mapping[str, list]) -> None:
        check_placeholder_counts(where, found, {m: len(items) for m, items in given.items()}, self.token_names,
                                 by_token=True)

    def _mrope_items(self, ranges: list[PlaceholderRange], ordered: list[VisionItem]) -> list[MRopeItem]:
        return [MRopeItem(off, n, self._merged_grid(item), item.time_interval) for (off, n), item in zip(ranges, ordered)]

    def _merged_grid(self, item: VisionItem) -> tuple[int, int, int]:
        t, h, w = item.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    def item_options(self, modality: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The request's options that apply to an item of `modality` (an image has no fps)."""
        return {k: v for k, v in kwargs.items() if k != "fps" or modality == "video"}

    def processor_call_kwargs(self, modality: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """An item's options as the HF processor's own arguments: min/max_pixels as its `size`
        (shortest_edge / longest_edge; the form every supported transformers honours), fps as
        its `fps` (the Qwen3-VL video processor's sampling rate)."""
        call: dict[str, Any] = {}
        if "min_pixels" in options or "max_pixels" in options:
            proc = self.image_processor if modality == "image" else self.video_processor
            size = dict(proc.size)
            size["shortest_edge"] = options.get("min_pixels", size.get("shortest_edge"))
            size["longest_edge"] = options.get("max_pixels", size.get("longest_edge"))
            call["size"] = size
        if modality == "video" and "fps" in options:
            call["fps"] = options["fps"]
        return call

    def _replacement(self, where: str, modality: str, item: Any, kwargs: Mapping[str, Any]) -> Replacement:
        """What the processor writes for one item, probed at its size, frame count and options."""
        if isinstance(item, GivenEmbedsItem):  # no pixels: the processor's text for the given grid
            grid = torch.tensor([item.grid_thw])
            return Replacement("image", self.hf_processor.replace_image_token({"image_grid_thw": grid}, 0),
                               {"image_grid_thw": list(item.grid_thw)})
        if modality == "video" and self.video_processor is None:
            raise ValueError(f"{where}: this checkpoint's processor has no video processor")
        frames = item if isinstance(item, list) else [item]
        width, height = frames[0].width, frames[0].height
        call = self.processor_call_kwargs(modality, self.item_options(modality, kwargs))
        try:
            return self.probe.replacement(modality, width, height, len(frames), call, where)
        except ValueError as exc:  # e.g. an aspect ratio over 200, too few frames
            what = f"{width}x{height} image" if modality == "image" else f"{len(frames)}-frame {width}x{height} video"
            raise ValueError(f"{where}: got a {what}: {_reason(exc, where)}") from None

    def _item(self, where: str, modality: str, given: Any, rep: Replacement, ids: list[int],
              rng: PlaceholderRange, kwargs: Mapping[str, Any]) -> tuple[Any, PlaceholderRange]:
        """The item and its placeholder range (its run of image / video tokens)."""
        rng = feature_run(where, ids, rng, self.token_ids[modality], f"a {modality}")
        grid = tuple(int(x) for x in rep.outputs[f"{modality}_grid_thw"])
        t, h, w = grid
        check_feature_rows(where, f"a {modality} with patch grid {grid}", rng.length, t * h * w // self.merge_size ** 2)
        if isinstance(given, GivenEmbedsItem):
            return given, rng
        frames = given if isinstance(given, list) else [given]
        options = self.item_options(modality, kwargs)
        interval = 1.0
        if modality == "video" and self.tokens_per_second is not None:
            # Qwen2.5-VL: `fps` is the given frames' rate (transformers assumes 24 without metadata).
            fps = options.get("fps", _CLIP_FPS_WITHOUT_METADATA)
            interval = self.tokens_per_second * self.video_processor.temporal_patch_size / fps
        return VisionItem(modality, frames, grid, rng.length, options, interval, rep.text, where), rng

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: VisionItem) -> MultiModalKwargs:
        """One item -> {"pixel_values": [num_patches, C*T*P*P], "grid_thw": [1, 3]} via the HF
        processor's call on its pixels (the model's `embed_multimodal` input)."""
        _, out = self.processor_outputs(item)
        suffix = "" if item.modality == "image" else "_videos"
        return {"pixel_values": out[f"pixel_values{suffix}"], "grid_thw": out[f"{item.modality}_grid_thw"]}

    def processor_outputs(self, item: VisionItem) -> tuple[Replacement, Any]:
        """The processor on the item's pixels with its options; it must write the text the item
        was expanded with."""
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        where = item.where or item.frames[0].where
        rep, out = call_processor(self.hf_processor, item.modality, frames,
                                  self.processor_call_kwargs(item.modality, item.processor_kwargs), where)
        if rep.text != item.replacement:
            grid = tuple(rep.outputs.get(f"{item.modality}_grid_thw", ()))
            raise ValueError(f"{where}: the processor produced a {grid} patch grid where {item.grid_thw} was "
                             "predicted; refusing to misalign the placeholders")
        return rep, out

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(token_ids, **kwargs)


def _reason(exc: ValueError, where: str) -> str:
    """The processor's own words for refusing an item (`call_processor` wraps them)."""
    cause = exc.__context__
    if isinstance(cause, (ValueError, TypeError)):
        return str(cause)
    return str(exc).removeprefix(f"{where}: ")
