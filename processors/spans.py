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
from mmkit.processors.replacements import Expansion, Replacement, expand_token_ids, placeholder_token


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


def expand_token_ids_keeping_spans(hf_processor: Any, tokenizer: Any, where: str, ids: Sequence[int],
                                   replacements: dict[str, Sequence[Replacement]]) -> Expansion:
    """`expand_token_ids` for families whose span starts before its placeholder token (Idefics3's
    `<fake_token_around_image>`, Gemma 3's newlines before `<start_of_image>`): a span already written out in
    full is kept wherever it starts; the placeholders between such spans are expanded by the
    processor (`expand_token_ids` on each stretch of the prompt between them)."""
    placeholder_ids = {tokenizer.convert_tokens_to_ids(placeholder_token(hf_processor, m)): m for m in replacements}
    spans = {m: [list(tokenizer(r.text, add_special_tokens=False).input_ids) for r in reps]
             for m, reps in replacements.items()}
    next_index = {m: 0 for m in replacements}
    out, ranges, order = [], [], []
    stretch: dict[str, list[int]] = {m: [] for m in replacements}  # items placed by a placeholder

    def flush(start: int, end: int) -> None:
        exp = expand_token_ids(hf_processor, tokenizer, where, ids[start:end],
                               {m: [replacements[m][k] for k in stretch[m]] for m in replacements},
                               allow_expanded=False)
        ranges.extend(PlaceholderRange(len(out) + r.offset, r.length) for r in exp.ranges)
        order.extend((m, stretch[m][k]) for m, k in exp.order)
        out.extend(exp.token_ids)
        for m in stretch:
            stretch[m] = []

    start = i = 0
    while i < len(ids):
        written = next((m for m in replacements if next_index[m] < len(spans[m]) and len(spans[m][next_index[m]]) > 1
                        and list(ids[i:i + len(spans[m][next_index[m]])]) == spans[m][next_index[m]]), None)
        if written is not None:
            flush(start, i)
            span = spans[written][next_index[written]]
            ranges.append(PlaceholderRange(len(out), len(span)))
            order.append((written, next_index[written]))
            out.extend(span)
            next_index[written] += 1
            i = start = i + len(span)
            continue
        modality = placeholder_ids.get(ids[i])
        if modality is not None:
            if next_index[modality] == len(spans[modality]):
                raise ValueError(_count_message(where, ids, placeholder_ids, replacements))
            stretch[modality].append(next_index[modality])
            next_index[modality] += 1
        i += 1
    if any(next_index[m] != len(spans[m]) for m in replacements):
        raise ValueError(_count_message(where, ids, placeholder_ids, replacements))
    flush(start, len(ids))
    return Expansion(out, ranges, order)


def _count_message(where: str, ids: Sequence[int], placeholder_ids: dict[int, str],
                   replacements: dict[str, Sequence[Replacement]]) -> str:
    found = {m: sum(1 for t in ids if placeholder_ids.get(t) == m) for m in replacements}
    parts = [f"{found[m]} {m} placeholder(s) for {len(reps)} {m}(s)" for m, reps in replacements.items()
             if found[m] or reps]
    return (f"{where}: the prompt has " + " and ".join(parts) + "; expected one placeholder token per item "
            "(token-id prompts may also hold each span exactly as the processor writes it)")


def check_text_placeholders(where: str, prompt: str, placeholders: dict[str, str], counts: dict[str, int]) -> None:
    """A text prompt holds one placeholder (`placeholders[modality]`, e.g. `<image>`) per item."""
    found = {m: prompt.count(token) for m, token in placeholders.items()}
    if all(found[m] == counts.get(m, 0) for m in placeholders):
        return
    parts = [f"{found[m]} {token} placeholder(s) for {counts.get(m, 0)} {m}(s)" for m, token in placeholders.items()
             if found[m] or counts.get(m, 0)]
    raise ValueError(f"{where}: the prompt has " + " and ".join(parts) + "; expected one placeholder per item")
