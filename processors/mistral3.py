"""Mistral 3 input processing with the checkpoint's PixtralProcessor.

Up front: each image's span is what the processor writes for it (`processors/replacements.py`:
rows of `[IMG]`, each ending in `[IMG_BREAK]`, the last in `[IMG_END]`), probed at the image's
size; the `[IMG]` count is checked against the model's feature rows for the size the processor
resizes to. When the image is scheduled, the same processor call on its pixels gives
`pixel_values [1, 3, H, W]` and `image_sizes`, and must write the same span.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mmkit.multimodal.inputs import MultiModalKwargs
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.replacements import (ReplacementProbe, call_processor, check_feature_rows, expand_text,
                                           expand_token_ids)
from mmkit.processors.span_embeds_input import GivenSpanItem, given_item_inputs, given_span_embeds
from mmkit.processors.spans import SpanItem, checked_token_ids


class Mistral3InputProcessor(BaseInputProcessor):
    """`InputProcessor` of Mistral3ForConditionalGeneration (images of any size; no options)."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        hf = self.load_hf_processor(tokenizer_path)
        self.image_token_id = hf.image_token_id
        if self.image_token_id != model_config.hf_config.image_token_id:
            raise ValueError(f"model: the processor's image token {hf.image_token!r} has id {self.image_token_id}; "
                             f"the model config's image_token_index is {model_config.hf_config.image_token_id}")
        vision = model_config.hf_config.vision_config
        self.step = vision.patch_size * model_config.hf_config.spatial_merge_size  # pixels per feature row
        self.probe = ReplacementProbe(hf)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        self.request_options(where, parsed)  # refuses any: Mistral 3 takes no processor options
        given = None
        if parsed.image_embeds is not None:
            given = given_span_embeds(where, parsed, name=self.name, hidden_size=self.model_config.hidden_size,
                                      max_images=self.max_images, image_token_id=self.image_token_id,
                                      tokenizer=self.tokenizer, replacement=self._given_replacement)
            reps = [g.rep for g in given]
            wheres = [f"{where}.multi_modal_data.image[{i}]" for i in range(len(given))]
        else:
            self.check_item_counts(where, {"image": parsed.num_images})
            images = list(parsed.images)
            wheres = [f"{where}.multi_modal_data.image[{i}]" for i in range(len(images))]
            reps = [self.probe.replacement("image", im.width, im.height, 1, {}, w) for im, w in zip(images, wheres)]
        if parsed.prompt is not None:
            exp = expand_text(self.hf_processor, self.tokenizer, where, parsed.prompt, {"image": reps})
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            exp = expand_token_ids(self.hf_processor, self.tokenizer, where, ids, {"image": reps})
        items = []
        for (_, k), rng in zip(exp.order, exp.ranges):
            span = exp.token_ids[rng.offset:rng.offset + rng.length]
            if given is not None:  # its rows were checked against the span's [IMG] count
                items.append(GivenSpanItem("image", [], span, where=wheres[k], embeds=given[k].embeds,
                                           size=given[k].size))
                continue
            self._check_span(wheres[k], images[k], reps[k].outputs, span)
            items.append(SpanItem("image", [images[k]], span, where=wheres[k]))
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=exp.token_ids,
                               placeholder_ranges=exp.ranges, images=items)

    def _given_replacement(self, where: str, size: tuple[int, int] | None):
        """The span of an image of `size` (height, width), as the processor writes it."""
        if size is None:
            raise ValueError(f"{where}: got image embeddings without 'image_sizes'; {self.name} lays an image out "
                             "by its size: pass {'image_embeds': [tokens, hidden_size], 'image_sizes': [N, 2]} "
                             "(each image's (height, width), e.g. the PixtralProcessor's image_sizes)")
        return self.probe.replacement("image", size[1], size[0], 1, {}, where)

    def _check_span(self, where: str, image, outputs: Mapping[str, Any], span: list[int]) -> None:
        """The model gives one feature row per merged patch of the size the processor resizes to."""
        height, width = outputs["image_sizes"]
        check_feature_rows(where, f"an image of {image.width}x{image.height}",
                           sum(1 for t in span if t == self.image_token_id),
                           (height // self.step) * (width // self.step), f" (resized to {width}x{height})")

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [1, 3, H, W], "image_sizes": [1, 2] (H, W), "span_ids": [L]}
        (given embeddings: {"image_embeds": [n, hidden], "span_ids": [L]})."""
        if isinstance(item, GivenSpanItem):
            return given_item_inputs(item)
        rep, out = call_processor(self.hf_processor, "image", [item.frames[0].to_pil()], {}, item.where)
        if self.tokenizer(rep.text, add_special_tokens=False).input_ids != item.span_ids:
            raise ValueError(f"{item.where}: the processor wrote a different span for the image's pixels than for "
                             "its size; refusing to misalign the placeholders")
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"],
                "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}
