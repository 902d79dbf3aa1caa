"""Placeholder spans: an item whose prompt tokens are not one run of image tokens.

Pixtral (Mistral 3) writes each image as rows of `[IMG]` tokens, each row ending in
`[IMG_BREAK]` and the last in `[IMG_END]`; Idefics3 / SmolVLM write every tile as
`<fake_token_around_image><row_i_col_j><image>*N` with newlines between rows and the global
view last (a SmolVLM video: every frame's view after its timestamp text). The processor
records the whole span as the item's placeholder range; the model returns one row per span
token (`models/span_embeds.py`): the image features at the image-token positions and the
ordinary token embeddings elsewhere, exactly the rows transformers' merge produces. So the
engine's one merge (by range, `merge_multimodal_embeddings`) needs nothing more.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from mmkit.multimodal.items import ImageItem
from mmkit.models.interfaces import PlaceholderRange


@dataclass
class SpanItem:
    """One image or video of a prompt with the exact token ids of its placeholder span."""

    modality: str  # "image" | "video"
    frames: list[ImageItem]  # one frame for an image
    span_ids: list[int]  # the span's token ids, as the HF processor writes them
    options: dict[str, Any] = field(default_factory=dict)  # effective processor options of the item
    where: str = "image"
    _hash: str | None = field(default=None, repr=False, compare=False)

    @property
    def processor_options(self) -> dict[str, Any]:
        return self.options

    @property
    def layout(self) -> str:
        return ""  # the span itself is the layout (part of the hash)

    def content_hash(self) -> str:
        """SHA-256 over the modality, the options, the span and every frame's pixels: the same
        image split differently never shares cached embeddings or KV blocks."""
        if self._hash is None:
            h = hashlib.sha256()
            h.update(f"{self.modality}:{json.dumps(self.options, sort_keys=True)}:{self.span_ids}:".encode())
            for frame in self.frames:
                h.update(frame.content_hash().encode())
            self._hash = h.hexdigest()
        return self._hash


def expand_spans(where: str, ids: Sequence[int], placeholder_ids: dict[str, int], items: Sequence[SpanItem],
                 allow_expanded: bool) -> tuple[list[int], list[PlaceholderRange]]:
    """Replace each item's placeholder token (`placeholder_ids[item.modality]`, once per item, in
    order) by its span; with `allow_expanded` (token-id prompts) a span already written out in
    full is kept as it is. Every item must be matched and every placeholder used."""
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    k = i = 0
    placeholders = set(placeholder_ids.values())
    while i < len(ids):
        item = items[k] if k < len(items) else None
        span = item.span_ids if item is not None else None
        if allow_expanded and span and len(span) > 1 and list(ids[i:i + len(span)]) == span:
            ranges.append(PlaceholderRange(len(out), len(span)))
            out.extend(span)
            i += len(span)
            k += 1
            continue
        if ids[i] in placeholders:
            if item is None or ids[i] != placeholder_ids[item.modality]:
                raise ValueError(count_error(where, ids, placeholder_ids, items))
            ranges.append(PlaceholderRange(len(out), len(span)))
            out.extend(span)
            k += 1
        else:
            out.append(ids[i])
        i += 1
    if k != len(items):
        raise ValueError(count_error(where, ids, placeholder_ids, items))
    return out, ranges


def checked_token_ids(where: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """A token-id prompt's ids, each below the vocabulary size."""
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{where}.prompt_token_ids: got token id {bad[0]}; expected ids in [0, {vocab_size})")
    return list(ids)


def count_error(where: str, ids: Sequence[int], placeholder_ids: dict[str, int], items: Sequence[SpanItem]) -> str:
    parts = []
    for modality, tid in placeholder_ids.items():
        given = sum(1 for it in items if it.modality == modality)
        found = sum(1 for t in ids if t == tid)
        if given or found:
            parts.append(f"{found} {modality} placeholder(s) for {given} {modality}(s)")
    return (f"{where}: the prompt has " + " and ".join(parts) + "; expected one placeholder token per item "
            "(token-id prompts may also hold each span exactly as the processor writes it)")
