"""InternVL `-HF` input processing with the checkpoint's own `InternVLProcessor`.

Up front (cheap, every prompt of a call before any is added): what the processor writes for
each image at its size and tiling options (`min_patches`, `max_patches`, `crop_to_patches`;
engine-wide and per request through `mm_processor_kwargs`), read from its own output
(`processors/replacements.py`): `<img>` + tiles * image_seq_length `<IMG_CONTEXT>` + `</img>`
(only the context tokens are the item's placeholder range), checked against the model's rows for
the tile count the processor reports. The options are written into the item's `layout`, so they
are part of its content hash (encoder cache and prefix-cache keys). At scheduling time the same
processor call on the pixels gives `pixel_values [tiles, 3, S, S]` and must write the same text.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Mapping

from mmkit.models.internvl import tokens_per_tile
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.llava import LlavaInputProcessor
from mmkit.processors.mm_kwargs import BOOL, POSITIVE_INT, check_min_le_max
from mmkit.processors.replacements import Replacement, call_processor

ALLOWED_MM_PROCESSOR_KWARGS = {"min_patches": POSITIVE_INT, "max_patches": POSITIVE_INT, "crop_to_patches": BOOL}
_LAYOUT_PREFIX = "internvl_tiling="




class InternVLInputProcessor(LlavaInputProcessor):
    """`InputProcessor` of InternVL: size- and option-dependent tile counts, `<img>...</img>` runs."""

    mm_processor_rules = ALLOWED_MM_PROCESSOR_KWARGS
    mm_processor_example = "{'max_patches': 6}"

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        hf = self.hf_processor
        if self.probe is None:
            raise ValueError(f"model: {model_config.architecture} needs the checkpoint's processor "
                             f"(processor_config.json and the tokenizer files) in {model_config.path!r}")
        self.tokens_per_tile = tokens_per_tile(model_config.hf_config)
        if hf.image_seq_length != self.tokens_per_tile:
            raise ValueError(f"model: the processor's image_seq_length is {hf.image_seq_length} but the model "
                             f"gives {self.tokens_per_tile} rows per tile; expected them equal")
        self.start_id, self.end_id = hf.start_image_token_id, hf.end_image_token_id

    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        kwargs = self.request_options(where, parsed)
        layout = _LAYOUT_PREFIX + json.dumps(kwargs, sort_keys=True) if kwargs else ""
        tagged = replace(parsed, images=[replace(item, layout=layout) for item in parsed.images],
                         mm_processor_kwargs=None)
        processed = super().process(tagged)
        processed.mm_processor_kwargs = kwargs
        return processed

    def check_mm_processor_kwargs(self, where: str, kwargs: Any) -> dict[str, Any]:
        checked = super().check_mm_processor_kwargs(where, kwargs)
        check_min_le_max(where, checked, "min_patches", "max_patches")
        return checked

    def processor_kwargs(self, item: ImageItem) -> dict[str, Any]:
        return _tiling(item)

    def model_rows(self, item: ImageItem, rep: Replacement | None = None) -> int:
        """image_seq_length rows per tile, for the tiles the processor cut."""
        return int(rep.outputs["pixel_values_shape"][0]) * self.tokens_per_tile

    def _expand(self, where: str, ids: list[int], counts: list[int],
                allow_expanded: bool) -> tuple[list[int], list[PlaceholderRange]]:
        """The parent's expansion, then `<img>` / `</img>` around every run it expanded from a
        single placeholder (as InternVLProcessor writes it, always for a text prompt); a run
        of a token-id prompt already between `<img>` and `</img>` is kept as given."""
        expanded, ranges = super()._expand(where, ids, counts, allow_expanded)
        if not ranges:
            return expanded, ranges
        out: list[int] = []
        shifted: list[PlaceholderRange] = []
        pos = 0
        for offset, length in ranges:
            wrap = not allow_expanded or not (offset > 0 and expanded[offset - 1] == self.start_id
                        and offset + length < len(expanded) and expanded[offset + length] == self.end_id)
            out.extend(expanded[pos:offset])
            if wrap:
                out.append(self.start_id)
            shifted.append(PlaceholderRange(len(out), length))
            out.extend(expanded[offset:offset + length])
            if wrap:
                out.append(self.end_id)
            pos = offset + length
        out.extend(expanded[pos:])
        return out, shifted

    def _check_embeds(self, where: str, embeds) -> None:
        hidden = self.model_config.hidden_size
        if embeds.ndim != 3 or embeds.shape[2] != hidden or embeds.shape[1] % self.tokens_per_tile:
            raise ValueError(
                f"{where}.multi_modal_data: got image embeddings of shape {tuple(embeds.shape)}; expected "
                f"[N, tiles * {self.tokens_per_tile}, {hidden}] (tiles * image_seq_length, hidden_size)")

    def _placeholder_name(self) -> str:
        return self.hf_processor.image_token

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: ImageItem) -> MultiModalKwargs:
        """One image -> {"pixel_values": [tiles, 3, S, S]} with the item's tiling options."""
        rep, out = call_processor(self.hf_processor, "image", [item.to_pil().convert("RGB")], _tiling(item),
                                  item.where)
        predicted = self.probe.replacement("image", item.width, item.height, 1, _tiling(item), item.where)
        if rep.text != predicted.text:
            raise ValueError(f"{item.where}: the processor cut {rep.outputs['pixel_values_shape'][0]} tiles where "
                             f"{predicted.outputs['pixel_values_shape'][0]} were predicted; refusing to misalign the "
                             "placeholders")
        return {"pixel_values": out["pixel_values"]}


def _tiling(item: ImageItem) -> dict[str, Any]:
    """The tiling options an item was tagged with in `process`."""
    return json.loads(item.layout[len(_LAYOUT_PREFIX):]) if item.layout.startswith(_LAYOUT_PREFIX) else {}
