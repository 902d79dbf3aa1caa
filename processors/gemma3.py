"""Gemma 3 input processing with the checkpoint's Gemma3Processor.

Up front (cheap): each image's pan-and-scan crop count from the image processor's own
`pan_and_scan_batched` on a shape-only tensor (no pixels), its text from the processor's own
`replace_image_token`; a text prompt is expanded by the processor's own
`get_text_with_replacements`, tokenized whole as transformers tokenizes it, and each image's
span found from its characters. A token-id prompt gets each span's tokens spliced in at its
`<start_of_image>` (or keeps a span already written out). Every run of image soft tokens is a
bidirectional range (transformers' `token_type_ids` = 1 there, one block per run). When
scheduled: the Gemma 3 image processor gives the image and its crops (`[views, 3, S, S]`).

Pan-and-scan options come per engine or per request (`mm_processor_kwargs`) under
Gemma3Processor's keys; its own defaults (off, crops of at least 256 px, at most 4, from an
aspect ratio of 1.2) apply before them, over the image processor's saved values, as in
transformers.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.mm_kwargs import BOOL, POSITIVE_INT, POSITIVE_NUMBER
from mmkit.processors.mm_kwargs import check_mm_processor_kwargs as check_options
from mmkit.processors.spans import SpanItem, checked_token_ids, expand_spans

# Gemma3Processor's image options (vLLM's `mm_processor_kwargs` for Gemma 3).
ALLOWED_MM_PROCESSOR_KWARGS = {"do_pan_and_scan": BOOL, "pan_and_scan_min_crop_size": POSITIVE_INT,
                               "pan_and_scan_max_num_crops": POSITIVE_INT,
                               "pan_and_scan_min_ratio_to_activate": POSITIVE_NUMBER}


def check_mm_processor_kwargs(where: str, kwargs: Any) -> dict[str, Any]:
    return check_options(where, kwargs, ALLOWED_MM_PROCESSOR_KWARGS,
                         "{'do_pan_and_scan': True, 'pan_and_scan_min_crop_size': 256}")


def soft_token_runs(ranges: list[PlaceholderRange], ids: list[int], image_token_id: int) -> list[PlaceholderRange]:
    """Each run of `image_token_id` inside the items' ranges (never elsewhere in the prompt)."""
    runs: list[PlaceholderRange] = []
    for offset, length in ranges:
        start = None
        for p in range(offset, offset + length + 1):
            inside = p < offset + length and ids[p] == image_token_id
            if inside and start is None:
                start = p
            elif not inside and start is not None:
                runs.append(PlaceholderRange(start, p - start))
                start = None
    return runs


class Gemma3InputProcessor:
    """`InputProcessor` of Gemma3ForConditionalGeneration (images; pan-and-scan options)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        self.name = model_config.architecture
        self.model_config = model_config
        hf = self.hf_processor = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        self.tokenizer = hf.tokenizer
        self.image_processor = hf.image_processor
        self.chat_template = getattr(hf, "chat_template", None)
        self.vocab_size = model_config.vocab_size
        hf_config = model_config.hf_config
        self.placeholder = hf.image_token  # `<start_of_image>` in prompts
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.image_token_id = self.tokenizer.image_token_id  # the soft token the features replace
        if self.image_token_id != hf_config.image_token_id:
            raise ValueError(f"model: the processor's image soft token {self.tokenizer.image_token!r} has id "
                             f"{self.image_token_id}; the model config's image_token_index is {hf_config.image_token_id}")
        self.tokens_per_view = int(hf_config.mm_tokens_per_image)
        if hf.image_seq_length != self.tokens_per_view:
            raise ValueError(f"model: the processor writes image_seq_length = {hf.image_seq_length} soft tokens per "
                             f"image; the model's projector gives mm_tokens_per_image = {self.tokens_per_view}")
        self.max_images = int(limit_mm_per_prompt.get("image", 8))
        self.default_kwargs = check_mm_processor_kwargs("mm_processor_kwargs", mm_processor_kwargs)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.image_embeds is not None:
            raise ValueError(f"{where}.multi_modal_data: image embeddings are not supported for {self.name}; "
                             "pass images")
        options = {**self.default_kwargs,
                   **check_mm_processor_kwargs(f"{where}.mm_processor_kwargs", parsed.mm_processor_kwargs)}
        if parsed.num_images > self.max_images:
            raise ValueError(f"{where}.multi_modal_data: got {parsed.num_images} images; expected at most "
                             f"limit_mm_per_prompt['image'] = {self.max_images}")
        image_options = self._image_options(options)
        images = list(parsed.images)
        texts = [self._image_text(image, image_options) for image in images]
        if parsed.prompt is not None:
            ids, ranges = self._expand_text(where, parsed.prompt, texts)
            items = [self._item(where, k, image, ids[lo:lo + n], image_options)
                     for k, (image, (lo, n)) in enumerate(zip(images, ranges))]
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            items = [self._item(where, k, image, list(self.tokenizer(text, add_special_tokens=False).input_ids),
                                image_options) for k, (image, text) in enumerate(zip(images, texts))]
            ids, ranges = expand_spans(where, ids, {"image": self.placeholder_id}, items, allow_expanded=True)
        for item in items:
            self._check_span(item)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=ids,
                               placeholder_ranges=ranges, images=items, mm_processor_kwargs=options,
                               bidirectional_ranges=soft_token_runs(ranges, ids, self.image_token_id))

    def _image_options(self, options: dict) -> dict[str, Any]:
        """The image processor's keyword arguments: Gemma3Processor's defaults, then `options`
        (transformers' own merge, so the precedence is the reference's)."""
        merged = self.hf_processor._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, **options)
        return dict(merged["images_kwargs"])

    def _num_crops(self, image: ImageItem, image_options: dict) -> int:
        if not image_options.get("do_pan_and_scan"):
            return 0
        # The image processor's own crop rule on a shape-only image (stride 0: no pixels): the
        # torchvision backend's batched form, or the PIL backend's per-image one.
        args = (image_options["pan_and_scan_min_crop_size"], image_options["pan_and_scan_max_num_crops"],
                image_options["pan_and_scan_min_ratio_to_activate"])
        batched = getattr(self.image_processor, "pan_and_scan_batched", None)
        if batched is not None:
            return len(batched(torch.zeros(()).expand(1, 3, image.height, image.width), *args))
        import numpy as np

        return len(self.image_processor.pan_and_scan(np.broadcast_to(np.zeros((), np.uint8),
                                                                     (3, image.height, image.width)), *args))

    def _image_text(self, image: ImageItem, image_options: dict) -> str:
        return self.hf_processor.replace_image_token({"num_crops": [self._num_crops(image, image_options)]}, 0)

    def _expand_text(self, where: str, prompt: str, texts: list[str]) -> tuple[list[int], list[PlaceholderRange]]:
        """The processor's own placeholder replacement, the text tokenized whole, each image's
        span from its characters (the tokens are transformers')."""
        found = prompt.count(self.placeholder)
        if found != len(texts):
            raise ValueError(f"{where}: the prompt has {found} {self.placeholder} placeholder(s) for {len(texts)} "
                             "image(s); expected one placeholder per image")
        if not texts:
            return list(self.tokenizer(prompt).input_ids), []
        expanded, offsets = self.hf_processor.get_text_with_replacements([prompt], texts)
        encoding = self.tokenizer(expanded[0])
        ranges: list[PlaceholderRange] = []
        for entry in offsets[0]:
            first, last = _token_bounds(encoding, *entry["new_span"])
            if ranges and first < ranges[-1].offset + ranges[-1].length:
                raise ValueError(f"{where}: two {self.placeholder} placeholders share a token; separate them")
            ranges.append(PlaceholderRange(first, last - first + 1))
        if len(ranges) != len(texts):  # pragma: no cover - a placeholder the processor does not replace
            raise ValueError(f"{where}: the processor replaced {len(ranges)} of {len(texts)} placeholders")
        return list(encoding.input_ids), ranges

    def _item(self, where: str, k: int, image: ImageItem, span: list[int], image_options: dict) -> SpanItem:
        return SpanItem("image", [image], list(span), dict(image_options),
                        where=f"{where}.multi_modal_data.image[{k}]")

    def _check_span(self, item: SpanItem) -> None:
        """The span's soft tokens must be the model's feature rows for the image and its crops."""
        expected = self.tokens_per_view * (1 + self._num_crops(item.frames[0], item.options))
        got = sum(1 for t in item.span_ids if t == self.image_token_id)
        if got != expected:
            raise ValueError(f"{item.where}: the processor's text holds {got} image soft tokens but the model "
                             f"produces {expected} features for it; refusing to misalign them")

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [views, 3, S, S] (the image, then its crops), "span_ids": [L]}."""
        out = self.image_processor(images=[item.frames[0].to_pil()], return_tensors="pt", **item.options)
        pixels = out["pixel_values"]
        views = 1 + self._num_crops(item.frames[0], item.options)
        if pixels.shape[0] != views:
            raise ValueError(f"{item.where}: the image processor produced {pixels.shape[0]} views where {views} "
                             "were predicted; refusing to misalign the placeholders")
        return {"pixel_values": pixels, "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}


def _token_bounds(encoding, start: int, end: int) -> tuple[int, int]:
    """First and last token holding a character of [start, end) (a character no token holds,
    e.g. whitespace a tokenizer drops, is skipped)."""
    chars = range(start, end)
    first = next(t for t in (encoding.char_to_token(c) for c in chars) if t is not None)
    last = next(t for t in (encoding.char_to_token(c) for c in reversed(chars)) if t is not None)
    return first, last
