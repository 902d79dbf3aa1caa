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

from mmkit.processors.replacements import check_placeholder_counts

from mmkit.multimodal.items import ImageItem


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


def checked_token_ids(where: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """A token-id prompt's ids, each below the vocabulary size."""
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{where}.prompt_token_ids: got token id {bad[0]}; expected ids in [0, {vocab_size})")
    return list(ids)


def check_text_placeholders(where: str, prompt: str, placeholders: dict[str, str], counts: dict[str, int]) -> None:
    """A text prompt holds one placeholder (`placeholders[modality]`, e.g. `<image>`) per item."""
    check_placeholder_counts(where, {m: prompt.count(token) for m, token in placeholders.items()},
                             {m: counts.get(m, 0) for m in placeholders}, placeholders, by_token=True)
