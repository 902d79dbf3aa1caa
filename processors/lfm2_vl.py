"""LFM2-VL input processing with the checkpoint's own `Lfm2VlProcessor`.

Up front (cheap): each image's span is what the processor writes for it
(`processors/replacements.py`), probed on a blank image of its size: `<|image_start|>`, then for
a large image every tile as `<|img_row_i_col_j|>` + its `<image>` tokens and the thumbnail as
`<|img_thumbnail|>` + its tokens, or for a small one its tokens alone, then `<|image_end|>`. A
text prompt is expanded by the processor's own `get_text_with_replacements`; a token-id prompt
gets each `<image>` expanded the same way (or keeps a span already written out). The span's
`<image>` count is checked against the tower's rows for the views the processor cut
(`spatial_shapes` / downsample_factor^2 per view). When scheduled, the same processor call on the
pixels gives `pixel_values`, `spatial_shapes`, `pixel_attention_mask` and must write the same span.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from mmkit.models.interfaces import MultiModalKwargs
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.mm_kwargs import BOOL
from mmkit.processors.mm_kwargs import check_mm_processor_kwargs as check_options
from mmkit.processors.replacements import (ReplacementProbe, call_processor, check_feature_rows, expand_text,
                                           expand_token_ids)
from mmkit.processors.span_embeds_input import GivenSpanItem, given_item_inputs, given_span_embeds
from mmkit.processors.spans import SpanItem, check_text_placeholders, checked_token_ids

ALLOWED_MM_PROCESSOR_KWARGS = {"do_image_splitting": BOOL, "use_thumbnail": BOOL}


def check_mm_processor_kwargs(where: str, kwargs: Any) -> dict[str, Any]:
    return check_options(where, kwargs, ALLOWED_MM_PROCESSOR_KWARGS, "{'do_image_splitting': False}")


class _WithoutSpecialTokens:
    """The tokenizer as Lfm2VlProcessor calls it (`add_special_tokens=False`: the chat template
    writes the start token itself)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("add_special_tokens", False)
        return self._tokenizer(text, **kwargs)


class Lfm2VlInputProcessor:
    """`InputProcessor` of LFM2-VL (images)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        self.name = model_config.architecture
        self.model_config = model_config
        hf = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        self.hf_processor = hf
        self.tokenizer = hf.tokenizer
        self.prompt_tokenizer = _WithoutSpecialTokens(hf.tokenizer)
        self.image_processor = hf.image_processor
        self.chat_template = getattr(hf, "chat_template", None)
        self.vocab_size = model_config.vocab_size
        self.image_token_id = model_config.hf_config.image_token_id
        self.downsample_factor = model_config.hf_config.downsample_factor
        self.placeholders = {"image": hf.image_token}
        if hf.image_token_id != self.image_token_id:
            raise ValueError(f"model: the processor's image token {hf.image_token!r} has id {hf.image_token_id}; "
                             f"the model config's image_token_id is {self.image_token_id}")
        self.max_images = int(limit_mm_per_prompt.get("image", 8))
        self.default_kwargs = check_mm_processor_kwargs("mm_processor_kwargs", mm_processor_kwargs)
        self.probe = ReplacementProbe(hf)

    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        options = {**self.default_kwargs,
                   **check_mm_processor_kwargs(f"{where}.mm_processor_kwargs", parsed.mm_processor_kwargs)}
        given = None
        if parsed.image_embeds is not None:
            given = given_span_embeds(where, parsed, name=self.name, hidden_size=self.model_config.hidden_size,
                                      max_images=self.max_images, image_token_id=self.image_token_id,
                                      tokenizer=self.prompt_tokenizer, replacement=self._sized(options))
        images = list(parsed.images) if given is None else [None] * len(given)
        if len(images) > self.max_images:
            raise ValueError(f"{where}.multi_modal_data: got {len(images)} images; expected at most "
                             f"limit_mm_per_prompt['image'] = {self.max_images}")
        wheres = [f"{where}.multi_modal_data.image[{k}]" for k in range(len(images))]
        if parsed.prompt is not None:
            check_text_placeholders(where, parsed.prompt, self.placeholders, {"image": len(images)})
        reps = {"image": [g.rep for g in given] if given is not None else
                [self.probe.replacement("image", im.width, im.height, 1, options, w) for im, w in zip(images, wheres)]}
        if parsed.prompt is not None:
            exp = expand_text(self.hf_processor, self.prompt_tokenizer, where, parsed.prompt, reps)
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            exp = expand_token_ids(self.hf_processor, self.prompt_tokenizer, where, ids, reps)
        items = []
        for (_, k), rng in zip(exp.order, exp.ranges):
            if given is not None:  # its rows were checked against the span
                items.append(GivenSpanItem("image", [], exp.token_ids[rng.offset:rng.offset + rng.length],
                                           dict(options), where=wheres[k], embeds=given[k].embeds, size=given[k].size))
                continue
            item = SpanItem("image", [images[k]], exp.token_ids[rng.offset:rng.offset + rng.length], dict(options),
                            where=wheres[k])
            self._check_span(item, reps["image"][k].outputs)
            items.append(item)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=exp.token_ids,
                               placeholder_ranges=exp.ranges, images=items, mm_processor_kwargs=options)

    def _sized(self, options: dict[str, Any]):
        def replacement(where: str, size: tuple[int, int] | None):
            if size is None:
                raise ValueError(f"{where}: got image embeddings without 'image_sizes'; {self.name} lays an image out "
                                 "by its size (tiles and a thumbnail): pass {'image_embeds': [tokens, hidden_size], "
                                 "'image_sizes': [N, 2]} (each image's (height, width))")
            return self.probe.replacement("image", size[1], size[0], 1, options, where)
        return replacement

    def _check_span(self, item: SpanItem, outputs: Mapping[str, Any]) -> None:
        """The span's `<image>` tokens must be the tower's rows for the views the processor cut."""
        shapes = outputs["spatial_shapes"]
        shapes = [shapes] if shapes and not isinstance(shapes[0], list) else shapes
        rows = sum((h // self.downsample_factor) * (w // self.downsample_factor) for h, w in shapes)
        frame = item.frames[0]
        check_feature_rows(item.where, f"an image of {frame.width}x{frame.height}",
                           sum(1 for t in item.span_ids if t == self.image_token_id), rows, f" ({len(shapes)} views)")

    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [views, patches, 3 * P * P], "spatial_shapes": [views, 2],
        "pixel_attention_mask": [views, patches], "span_ids": [L]}."""
        if isinstance(item, GivenSpanItem):
            return given_item_inputs(item)
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        rep, out = call_processor(self.hf_processor, "image", frames, item.options, item.where)
        predicted = self.probe.replacement("image", frames[0].width, frames[0].height, 1, item.options, item.where)
        if rep.text != predicted.text:
            raise ValueError(f"{item.where}: the processor wrote a different span for the image's pixels than for "
                             "its size; refusing to misalign the placeholders")
        return {"pixel_values": out["pixel_values"], "spatial_shapes": out["spatial_shapes"],
                "pixel_attention_mask": out["pixel_attention_mask"],
                "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}
