"""Gemma 3 input processing with the checkpoint's Gemma3Processor.

Up front (cheap): each image's span is what the processor writes for it
(`processors/replacements.py`), probed on a blank image of its size with the request's
pan-and-scan options: `\\n\\n<start_of_image>`, image_seq_length soft tokens per view (the image,
then its crops), `<end_of_image>\\n\\n`. A text prompt is expanded by the processor's own
`get_text_with_replacements` and tokenized whole (the newlines merge with the text around them
as in transformers); a token-id prompt gets each `<start_of_image>` expanded the same way (or
keeps a span already written out). The soft-token count is checked against the model's rows for
the views the processor cut. Every run of image soft tokens is a bidirectional range
(transformers' `token_type_ids` = 1 there, one block per run). When scheduled, the same
processor call on the pixels gives `pixel_values [views, 3, S, S]` and must write the same span.

Pan-and-scan options come per engine or per request (`mm_processor_kwargs`) under
Gemma3Processor's keys and go into the processor call, so its own defaults and precedence apply.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.mm_kwargs import BOOL, POSITIVE_INT, POSITIVE_NUMBER
from mmkit.processors.replacements import (ReplacementProbe, call_processor, check_feature_rows, expand_text,
                                           expand_token_ids)
from mmkit.processors.span_embeds_input import GivenSpanItem, given_item_inputs, given_span_embeds, sized_or_one_view
from mmkit.processors.spans import SpanItem, check_text_placeholders, checked_token_ids

# Gemma3Processor's image options (vLLM's `mm_processor_kwargs` for Gemma 3).
ALLOWED_MM_PROCESSOR_KWARGS = {"do_pan_and_scan": BOOL, "pan_and_scan_min_crop_size": POSITIVE_INT,
                               "pan_and_scan_max_num_crops": POSITIVE_INT,
                               "pan_and_scan_min_ratio_to_activate": POSITIVE_NUMBER}


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


class Gemma3InputProcessor(BaseInputProcessor):
    """`InputProcessor` of Gemma3ForConditionalGeneration (images; pan-and-scan options)."""

    mm_processor_rules = ALLOWED_MM_PROCESSOR_KWARGS
    mm_processor_example = "{'do_pan_and_scan': True, 'pan_and_scan_min_crop_size': 256}"

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        hf = self.load_hf_processor(tokenizer_path)
        hf_config = model_config.hf_config
        self.placeholder = hf.image_token  # `<start_of_image>` in prompts
        self.image_token_id = self.tokenizer.image_token_id  # the soft token the features replace
        if self.image_token_id != hf_config.image_token_id:
            raise ValueError(f"model: the processor's image soft token {self.tokenizer.image_token!r} has id "
                             f"{self.image_token_id}; the model config's image_token_index is {hf_config.image_token_id}")
        self.tokens_per_view = int(hf_config.mm_tokens_per_image)
        if hf.image_seq_length != self.tokens_per_view:
            raise ValueError(f"model: the processor writes image_seq_length = {hf.image_seq_length} soft tokens per "
                             f"image; the model's projector gives mm_tokens_per_image = {self.tokens_per_view}")
        self.probe = ReplacementProbe(hf)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        options = self.request_options(where, parsed)
        given = None
        if parsed.image_embeds is not None:
            given = given_span_embeds(where, parsed, name=self.name, hidden_size=self.model_config.hidden_size,
                                      max_images=self.max_images, image_token_id=self.image_token_id,
                                      tokenizer=self.tokenizer,
                                      replacement=sized_or_one_view(self.probe, options, {"do_pan_and_scan": False}))
            num_images = len(given)
        else:
            self.check_item_counts(where, {"image": parsed.num_images})
            images = list(parsed.images)
            num_images = len(images)
        wheres = [f"{where}.multi_modal_data.image[{k}]" for k in range(num_images)]
        if parsed.prompt is not None:  # the count first: a clear error before any processor call
            check_text_placeholders(where, parsed.prompt, {"image": self.placeholder}, {"image": num_images})
        if given is not None:
            reps = [g.rep for g in given]
        else:
            reps = [self.probe.replacement("image", im.width, im.height, 1, options, w)
                    for im, w in zip(images, wheres)]
        if parsed.prompt is not None:
            exp = expand_text(self.hf_processor, self.tokenizer, where, parsed.prompt, {"image": reps})
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            exp = expand_token_ids(self.hf_processor, self.tokenizer, where, ids, {"image": reps})
        items = []
        for (_, k), rng in zip(exp.order, exp.ranges):
            if given is not None:  # its rows were checked against the span's soft tokens
                items.append(GivenSpanItem("image", [], exp.token_ids[rng.offset:rng.offset + rng.length],
                                           dict(options), where=wheres[k], embeds=given[k].embeds, size=given[k].size))
                continue
            item = SpanItem("image", [images[k]], exp.token_ids[rng.offset:rng.offset + rng.length], dict(options),
                            where=wheres[k])
            self._check_span(item, reps[k].outputs)
            items.append(item)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=exp.token_ids,
                               placeholder_ranges=exp.ranges, images=items, mm_processor_kwargs=options,
                               bidirectional_ranges=soft_token_runs(exp.ranges, exp.token_ids, self.image_token_id))

    def _check_span(self, item: SpanItem, outputs: Mapping[str, Any]) -> None:
        """The span's soft tokens must be the model's feature rows: mm_tokens_per_image per view
        the processor cut (the image and its crops)."""
        views = int(outputs["pixel_values_shape"][0])  # [views, 3, S, S]
        image = item.frames[0]
        check_feature_rows(item.where, f"an image of {image.width}x{image.height}",
                           sum(1 for t in item.span_ids if t == self.image_token_id), self.tokens_per_view * views,
                           f" ({views} views)")

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [views, 3, S, S] (the image, then its crops), "span_ids": [L]}
        (given embeddings: {"image_embeds": [views * mm_tokens_per_image, hidden], "span_ids": [L]})."""
        if isinstance(item, GivenSpanItem):
            return given_item_inputs(item)
        image = item.frames[0].to_pil()
        rep, out = call_processor(self.hf_processor, "image", [image], item.options, item.where)
        predicted = self.probe.replacement("image", image.width, image.height, 1, item.options, item.where)
        if rep.text != predicted.text:
            raise ValueError(f"{item.where}: the processor wrote a different span for the image's pixels "
                             f"({rep.outputs['pixel_values_shape'][0]} views) than for its size "
                             f"({predicted.outputs['pixel_values_shape'][0]} views); refusing to misalign the "
                             "placeholders")
        return {"pixel_values": out["pixel_values"], "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}
