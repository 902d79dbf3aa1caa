"""Image embeddings given by the user for the span families (Mistral 3, Idefics3 / SmolVLM, Gemma 3).

    multi_modal_data={"image_embeds": embeds}                                  # [N, tokens, hidden]
    multi_modal_data={"image": {"image_embeds": embeds, "image_sizes": sizes}}  # sizes [N, 2] (height, width)

`embeds` are the image-token rows of each image's span only (what the family's vision path
writes into the span: `get_image_features` / the projector's output, every view's rows in
order), `[N, tokens, hidden_size]` or `[sum of the tokens, hidden_size]` with `image_sizes`. The
span around them (Pixtral's `[IMG_BREAK]` rows, Idefics3's tiles, Gemma 3's crops) is what the
checkpoint's processor writes for an image of that size with the request's options, probed on a
blank image; without `image_sizes` every image is one view (Idefics3 / SmolVLM: the global view
alone; Gemma 3: no pan-and-scan crops; Mistral 3 needs the size). The row count is checked
against the span before anything is added; the model writes the rows into the span
(`models/span_embeds.py`) as it does its own features, so the tower is skipped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch
from mmkit.processors.mm_kwargs import integer_table
from mmkit.processors.replacements import Replacement, count_tokens
from mmkit.processors.spans import SpanItem

from mmkit.multimodal.hashing import embeds_content_hash
from mmkit.multimodal.items import check_image_size
from mmkit.multimodal.parse import ParsedPrompt

_FIELDS = ("image_sizes",)


@dataclass
class GivenSpanItem(SpanItem):
    """A span item whose image-token rows were given: `embeds` [num image tokens, hidden]."""

    embeds: torch.Tensor | None = None
    size: tuple[int, int] | None = None  # (height, width) given in image_sizes, if any

    @property
    def layout(self) -> str:
        return "image_embeds"

    def content_hash(self) -> str:
        """The rows, the span (it holds the layout) and the options."""
        if self._hash is None:
            key = (f"image_embeds:{json.dumps(self.options, sort_keys=True)}:{self.span_ids}:"
                   f"{embeds_content_hash(self.embeds)}")
            self._hash = hashlib.sha256(key.encode()).hexdigest()
        return self._hash


@dataclass
class GivenSpan:
    rep: Replacement  # what the processor writes for the image
    embeds: torch.Tensor  # [num image tokens, hidden]
    size: tuple[int, int] | None


def sized_or_one_view(probe: Any, options: dict[str, Any], one_view: dict[str, Any]
                      ) -> Callable[[str, tuple[int, int] | None], Replacement]:
    """The probe for a family whose given image may come without a size: with `image_sizes`, the
    image's own layout under the request's options; without, one view (`one_view` turns the
    family's tiling or cropping off), which a blank image of any size gives."""
    def replacement(where: str, size: tuple[int, int] | None) -> Replacement:
        height, width = size or (32, 32)
        return probe.replacement("image", width, height, 1, options if size else {**options, **one_view}, where)
    return replacement


def given_span_embeds(where: str, parsed: ParsedPrompt, *, name: str, hidden_size: int, max_images: int,
                      image_token_id: int, tokenizer: Any,
                      replacement: Callable[[str, tuple[int, int] | None], Replacement]) -> list[GivenSpan]:
    """Check one prompt's given embeddings (and `image_sizes`); the span and rows of each image.
    `replacement(where_k, (height, width) | None)` is the family's probe (raises when a size is needed)."""
    where = f"{where}.multi_modal_data"
    fields = parsed.image_embeds_fields
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: got image embedding field(s) {unknown}; {name} reads only {list(_FIELDS)}")
    embeds = parsed.image_embeds
    if "image_sizes" in fields:
        sizes = _checked_sizes(where, fields["image_sizes"])
    else:  # a [tokens, hidden] dict entry is one image; a tensor [N, tokens, hidden] N images
        sizes = [None] * (1 if embeds.dim() == 2 else int(embeds.shape[0]))
    if len(sizes) > max_images:
        raise ValueError(f"{where}: got {len(sizes)} images; expected at most limit_mm_per_prompt['image'] = "
                         f"{max_images}")
    reps = [replacement(f"{where}.image[{k}]", size) for k, size in enumerate(sizes)]
    counts = [count_tokens(tokenizer, rep.text, image_token_id) for rep in reps]
    if embeds.dim() == 3 and embeds.shape[0] == len(sizes):
        flat = embeds.reshape(-1, embeds.shape[-1])
        ok = all(c == embeds.shape[1] for c in counts)
    else:
        flat, ok = embeds.reshape(-1, embeds.shape[-1]), embeds.dim() == 2
    if not ok or flat.shape[0] != sum(counts) or flat.shape[1] != hidden_size:
        shown = (f"[{len(sizes)}, {counts[0]}, {hidden_size}] or " if len(set(counts)) == 1 else "") + \
            f"[{sum(counts)}, {hidden_size}]"
        raise ValueError(
            f"{where}['image_embeds']: got shape {tuple(embeds.shape)}; expected {shown}: the image-token rows of "
            f"each image's span ({' + '.join(map(str, counts))}, as the processor lays out "
            + ("the given image_sizes" if "image_sizes" in fields else "one view per image; pass 'image_sizes' for "
               "tiled / cropped images") + f"), hidden_size {hidden_size}")
    out, start = [], 0
    for rep, n, size in zip(reps, counts, sizes):
        out.append(GivenSpan(rep, flat[start:start + n], size))
        start += n
    return out


def _checked_sizes(where: str, sizes: torch.Tensor) -> list[tuple[int, int]]:
    rows = [(h, w) for h, w in integer_table(where, "image_sizes", sizes, "height, width")]
    for k, (h, w) in enumerate(rows):
        if h < 1 or w < 1:
            raise ValueError(f"{where}['image_sizes'][{k}]: got {[h, w]}; expected a positive (height, width)")
        check_image_size(f"{where}['image_sizes'][{k}]", w, h)
    return rows


def given_item_inputs(item: GivenSpanItem) -> dict[str, torch.Tensor]:
    """The model inputs of a given item: {"image_embeds": [n, hidden], "span_ids": [L]}."""
    return {"image_embeds": item.embeds, "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}
