"""Mistral 3 input processing with the checkpoint's PixtralProcessor.

Up front: each image's merged patch grid from its size (the image processor's own resize
rule), checked against the HF processor's token count; `[IMG]` becomes the image's span
(`processors/spans.py`). When the image is scheduled: the Pixtral image processor gives its
pixels (`[1, 3, H, W]`, H and W multiples of patch x merge) and size, which must give the
predicted span (never a silent misalignment).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from mmkit.multimodal.parse import ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs
from mmkit.models.mistral3 import Mistral3ForConditionalGeneration, merged_grid
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.spans import SpanItem, checked_token_ids, expand_spans


class Mistral3InputProcessor:
    """`InputProcessor` of Mistral3ForConditionalGeneration (images of any size; no options)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        self.name = model_config.architecture
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs: got {dict(mm_processor_kwargs)!r}; {self.name} takes no "
                             "processor options")
        self.model_config = model_config
        self.hf_processor = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_processor = self.hf_processor.image_processor
        self.chat_template = getattr(self.hf_processor, "chat_template", None)
        self.vocab_size = model_config.vocab_size
        hf = self.hf_processor
        self.image_token_id = hf.image_token_id
        if self.image_token_id != model_config.hf_config.image_token_id:
            raise ValueError(f"model: the processor's image token {hf.image_token!r} has id {self.image_token_id}; "
                             f"the model config's image_token_index is {model_config.hf_config.image_token_id}")
        self.break_id, self.end_id = hf.image_break_token_id, hf.image_end_token_id
        self.step = hf.patch_size * hf.spatial_merge_size  # pixels per merged patch
        vision = model_config.hf_config.vision_config
        if self.step != vision.patch_size * model_config.hf_config.spatial_merge_size:
            raise ValueError(f"model: the processor's patch_size x spatial_merge_size is {self.step}; the model "
                             f"merges {vision.patch_size} x {model_config.hf_config.spatial_merge_size} pixels")
        self.max_images = int(limit_mm_per_prompt.get("image", 8))

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.mm_processor_kwargs:
            raise ValueError(f"{where}.mm_processor_kwargs: got {parsed.mm_processor_kwargs!r}; {self.name} takes "
                             "no processor options")
        if parsed.image_embeds is not None:
            raise ValueError(f"{where}.multi_modal_data: image embeddings are not supported for {self.name}; "
                             "pass images")
        if parsed.num_images > self.max_images:
            raise ValueError(f"{where}.multi_modal_data: got {parsed.num_images} images; expected at most "
                             f"limit_mm_per_prompt['image'] = {self.max_images}")
        items = [self._item(f"{where}.multi_modal_data.image[{i}]", image) for i, image in enumerate(parsed.images)]
        if parsed.prompt is not None:
            ids = list(self.tokenizer(parsed.prompt).input_ids)
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
        ids, ranges = expand_spans(where, ids, {"image": self.image_token_id}, items,
                                   allow_expanded=parsed.prompt is None)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=ids,
                               placeholder_ranges=ranges, images=items)

    def span_ids(self, rows: int, cols: int) -> list[int]:
        """PixtralProcessor's layout: each row `cols` [IMG] and a [IMG_BREAK]; the last one [IMG_END]."""
        span = ([self.image_token_id] * cols + [self.break_id]) * rows
        span[-1] = self.end_id
        return span

    def _item(self, where: str, image) -> SpanItem:
        hf_config = self.model_config.hf_config
        rows, cols = merged_grid(hf_config, (image.width, image.height), self.image_processor)
        span = self.span_ids(rows, cols)
        expected = int(self.hf_processor._get_num_multimodal_tokens(
            image_sizes=[(image.height, image.width)])["num_image_tokens"][0])
        got = Mistral3ForConditionalGeneration.get_num_placeholder_tokens(
            hf_config, (image.width, image.height), self.image_processor)
        if not expected == got == len(span):
            raise ValueError(f"{where}: for an image of {image.width}x{image.height} the checkpoint's processor "
                             f"writes {expected} image tokens but the model's layout has {got}; the processor "
                             "config (size, patch_size, spatial_merge_size) does not match the model config")
        return SpanItem("image", [image], span, where=where)

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [1, 3, H, W], "image_sizes": [1, 2] (H, W), "span_ids": [L]}."""
        step = {"height": self.step, "width": self.step}
        out = self.image_processor(images=[item.frames[0].to_pil()], patch_size=step, return_tensors="pt")
        height, width = (int(v) for v in out["image_sizes"][0])
        if self.span_ids(height // self.step, width // self.step) != item.span_ids:
            raise ValueError(f"{item.where}: the image processor resized the image to {width}x{height}, which does "
                             f"not give the predicted {len(item.span_ids)} span tokens; refusing to misalign them")
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"],
                "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}
