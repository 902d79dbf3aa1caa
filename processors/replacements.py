"""Placeholder spans read from what the checkpoint's processor writes, never from a formula.

transformers' processors build a prompt in two public steps: each item's replacement text
(what `replace_image_token` / `replace_video_token` return for the processed item), then the
prompt with its placeholders replaced (`get_text_with_replacements`, which may also rewrite
what surrounds a placeholder: Qwen3-VL under 5.25 collapses `<|vision_start|><|video_pad|>
<|vision_end|>` into the bare token first, 5.10-5.24 keep the outer pair). mmkit asks the
installed processor for both, so a new transformers release that changes either is followed
without a version table:

- an item's replacement text comes from the processor itself, run on the placeholder alone with
  `return_text_replacement_offsets=True`. Up front it runs on a blank item of the same size,
  frame count and options (the text depends on nothing else), cached by those, so a batch pays
  one image-processor call per distinct size; when the item is scheduled the same call on the
  real pixels gives its model inputs and must write the same text (never a silent misalignment);
- a text prompt is expanded by the processor's own `get_text_with_replacements` and tokenized
  whole by its tokenizer; an item's span is the tokens that hold its replaced characters;
- a token-id prompt: each placeholder together with the special tokens around it (a chat
  template's `<|vision_start|>`...) is expanded the same way and spliced in; a span already
  written out in full is kept as it is.

A family's own count (the model's feature rows for that size) is only a check against the span.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from threading import Lock
from typing import Any, Mapping, Sequence

from PIL import Image

from mmkit.multimodal.inputs import PlaceholderRange

# Processor outputs that are not per-item metadata (pixels and the tokenized text).
_NOT_METADATA_PREFIXES = ("pixel_", "input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                          "text_replacement_offsets")


@dataclass(frozen=True)
class Replacement:
    """What the processor writes for one item: its replacement text and its per-item outputs
    other than pixels (e.g. {"image_grid_thw": [1, 16, 16]}, {"image_sizes": [336, 448]})."""

    modality: str  # "image" | "video"
    text: str
    outputs: Mapping[str, Any] = field(default_factory=dict)


def placeholder_token(hf_processor: Any, modality: str) -> str:
    token = getattr(hf_processor, f"{modality}_token", None)
    if not token:
        raise ValueError(f"model: the checkpoint's processor {type(hf_processor).__name__} has no {modality} token")
    return token


def call_processor(hf_processor: Any, modality: str, frames: Sequence[Image.Image],
                   kwargs: Mapping[str, Any], where: str, in_multi_image_prompt: bool = False
                   ) -> tuple[Replacement, Any]:
    """The processor on one item's placeholder alone: (its replacement, the processor's output
    with return_tensors="pt"). `frames` is one image, or a video's frames. With
    `in_multi_image_prompt` the image is processed as one of two in a prompt (LLaVA-OneVision
    encodes those differently) and the first one's replacement is returned."""
    token = placeholder_token(hf_processor, modality)
    text = [token]
    media: dict[str, Any] = {"images": [frames[0]]} if modality == "image" else {"videos": [list(frames)]}
    if in_multi_image_prompt:
        text, media = [token * 2], {"images": [[frames[0], frames[0]]]}
    try:
        out = hf_processor(text=text, return_text_replacement_offsets=True, return_tensors="pt",
                           **media, **dict(kwargs))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: the checkpoint's processor refused this {modality} "
                         f"({frames[0].width}x{frames[0].height}, options {dict(kwargs)}): {exc}") from None
    offsets = out.get("text_replacement_offsets")
    if not offsets or not offsets[0]:
        raise ValueError(f"model: {type(hf_processor).__name__} returned no text_replacement_offsets; mmkit reads "
                         "placeholder spans from them (transformers >= 5.17)")
    # NOTE: batch-of-one outputs only; for a two-image probe the metadata is not per item.
    metadata = {} if in_multi_image_prompt else {k: _item_value(v) for k, v in out.items()
                                                 if not k.startswith(_NOT_METADATA_PREFIXES)}
    # The pixels' shapes (e.g. InternVL's tile count is the first dimension of its pixel_values).
    metadata.update({f"{k}_shape": list(v.shape) for k, v in out.items()
                     if k.startswith("pixel_values") and hasattr(v, "shape") and not in_multi_image_prompt})
    return Replacement(modality, offsets[0][0]["replacement"], metadata), out


def count_tokens(tokenizer: Any, text: str, token_id: int) -> int:
    """How many `token_id` tokens a replacement text holds (its feature rows)."""
    return sum(1 for t in tokenizer(text, add_special_tokens=False).input_ids if t == token_id)


def _item_value(value: Any) -> Any:
    """A batch-of-one output as plain Python: tensors as lists, the batch level dropped."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


class ReplacementProbe:
    """Replacement texts of items by (modality, size, frame count, options), probed with blank
    items and kept in a bounded LRU; thread-safe (the input stage runs on worker threads)."""

    def __init__(self, hf_processor: Any, max_entries: int = 4096) -> None:
        self.hf_processor = hf_processor
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple, Replacement] = OrderedDict()
        self._lock = Lock()

    def replacement(self, modality: str, width: int, height: int, num_frames: int,
                    kwargs: Mapping[str, Any], where: str, in_multi_image_prompt: bool = False) -> Replacement:
        key = (modality, width, height, num_frames, _freeze(kwargs), in_multi_image_prompt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        blank = Image.new("RGB", (width, height))
        found, _ = call_processor(self.hf_processor, modality, [blank] * num_frames, kwargs, where,
                                  in_multi_image_prompt)
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return found


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass
class Expansion:
    """A prompt with its placeholders expanded: ids, one range per item (the tokens of its
    replacement) and the items' indices in prompt order (`order[k]` = (modality, index))."""

    token_ids: list[int]
    ranges: list[PlaceholderRange]
    order: list[tuple[str, int]]


def expand_text(hf_processor: Any, tokenizer: Any, where: str, prompt: str,
                replacements: Mapping[str, Sequence[Replacement]]) -> Expansion:
    """The processor's own expansion of a text prompt, tokenized whole (as its `__call__` does)."""
    _check_counts(where, {m: prompt.count(placeholder_token(hf_processor, m)) for m in replacements}, replacements,
                  hf_processor)
    texts = {m: [r.text for r in reps] for m, reps in replacements.items()}
    if not any(texts.values()):
        return Expansion(list(tokenizer(prompt).input_ids), [], [])
    expanded, offsets = hf_processor.get_text_with_replacements(
        [prompt], images_replacements=texts.get("image", []), videos_replacements=texts.get("video", []))
    encoding = tokenizer(expanded[0])
    ranges, order = _ranges(where, encoding, offsets[0], hf_processor)
    return Expansion(list(encoding.input_ids), ranges, order)


def _ranges(where: str, encoding: Any, offsets: list[dict], hf_processor: Any, base: int = 0):
    ranges: list[PlaceholderRange] = []
    order: list[tuple[str, int]] = []
    seen = {"image": 0, "video": 0}
    for entry in offsets:
        first, last = _token_bounds(encoding, *entry["new_span"])
        if ranges and base + first < ranges[-1].offset + ranges[-1].length:
            raise ValueError(f"{where}: two placeholders ({placeholder_token(hf_processor, entry['type'])}) share a "
                             "token; separate them")
        ranges.append(PlaceholderRange(base + first, last - first + 1))
        order.append((entry["type"], seen[entry["type"]]))
        seen[entry["type"]] += 1
    return ranges, order


def _token_bounds(encoding, start: int, end: int) -> tuple[int, int]:
    """First and last token holding a character of [start, end) (a character no token holds,
    e.g. whitespace a tokenizer drops, is skipped)."""
    chars = range(start, end)
    first = next(t for t in (encoding.char_to_token(c) for c in chars) if t is not None)
    last = next(t for t in (encoding.char_to_token(c) for c in reversed(chars)) if t is not None)
    return first, last


def _check_counts(where: str, found: Mapping[str, int], replacements: Mapping[str, Sequence[Replacement]],
                  hf_processor: Any) -> None:
    check_placeholder_counts(where, found, {m: len(reps) for m, reps in replacements.items()},
                             {m: placeholder_token(hf_processor, m) for m in replacements})


def check_placeholder_counts(where: str, found: Mapping[str, int], given: Mapping[str, int],
                             tokens: Mapping[str, str], by_token: bool = False) -> None:
    """One placeholder per item, per modality: else a ValueError counting both, each modality
    named by itself ("2 image placeholder(s)") or, `by_token`, by its token ("2 <image> ...")."""
    if all(found[m] == given[m] for m in given):
        return
    parts = [f"{found[m]} {tokens[m] if by_token else m} placeholder(s) for {given[m]} {m}(s)" for m in given
             if found[m] or given[m]]
    raise ValueError(f"{where}: the prompt has " + " and ".join(parts) + f"; expected one placeholder "
                     f"({' or '.join(tokens[m] for m in given)}) per item")


def expand_token_ids(hf_processor: Any, tokenizer: Any, where: str, ids: Sequence[int],
                     replacements: Mapping[str, Sequence[Replacement]], allow_expanded: bool = True) -> Expansion:
    """A token-id prompt expanded as the processor expands the same text: each placeholder id,
    with the special tokens right around it, replaced by the processor's text tokenized without
    special tokens; with `allow_expanded`, the next item's span already written out in full is
    kept wherever it starts (Idefics3's spans begin with `<fake_token_around_image>`, Gemma 3's
    with the newlines before `<start_of_image>`, not with the placeholder)."""
    placeholder_ids = {tokenizer.convert_tokens_to_ids(placeholder_token(hf_processor, m)): m for m in replacements}
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
    queues = {m: list(enumerate(reps)) for m, reps in replacements.items()}
    found = {m: 0 for m in replacements}
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    order: list[tuple[str, int]] = []
    bare = {m: [_tokens(tokenizer, rep.text) for rep in reps] for m, reps in replacements.items()} \
        if allow_expanded else {}
    i = 0
    while i < len(ids):
        written = next((m for m in bare if queues[m] and len(span := bare[m][queues[m][0][0]]) > 1
                        and ids[i] == span[0] and list(ids[i:i + len(span)]) == span), None)
        if written is not None:  # the next item's span, as the processor writes it
            found[written] += 1
            index, _ = queues[written].pop(0)
            span = bare[written][index]
            ranges.append(PlaceholderRange(len(out), len(span)))
            order.append((written, index))
            out.extend(span)
            i += len(span)
            continue
        modality = placeholder_ids.get(ids[i])
        if modality is None:
            out.append(ids[i])
            i += 1
            continue
        found[modality] += 1
        if not queues[modality]:
            _check_counts(where, _count_placeholders(ids, placeholder_ids, replacements), replacements, hf_processor)
        index, rep = queues[modality].pop(0)
        # The window: the placeholder and the special tokens right around it (not inside an
        # earlier item's span, not another placeholder), expanded as text by the processor.
        floor = ranges[-1].offset + ranges[-1].length if ranges else 0
        left = 0
        while len(out) - left > floor and out[len(out) - left - 1] in special \
                and out[len(out) - left - 1] not in placeholder_ids:
            left += 1
        right = 0
        while i + 1 + right < len(ids) and ids[i + 1 + right] in special and ids[i + 1 + right] not in placeholder_ids:
            right += 1
        window = out[len(out) - left:] + list(ids[i:i + 1 + right])
        text = "".join(tokenizer.convert_ids_to_tokens(window))
        kw = {"images_replacements": [rep.text]} if modality == "image" else {"videos_replacements": [rep.text]}
        expanded, offsets = hf_processor.get_text_with_replacements([text], **kw)
        encoding = tokenizer(expanded[0], add_special_tokens=False)
        base = len(out) - left
        del out[base:]
        (rng,), _ = _ranges(where, encoding, offsets[0], hf_processor, base)
        ranges.append(rng)
        order.append((modality, index))
        out.extend(encoding.input_ids)
        i += 1 + right
    _check_counts(where, _count_placeholders(ids, placeholder_ids, replacements, found), replacements, hf_processor)
    return Expansion(out, ranges, order)


def _count_placeholders(ids, placeholder_ids, replacements, found=None) -> dict[str, int]:
    if found is not None and all(found[m] == len(replacements[m]) for m in replacements):
        return found
    counts = {m: 0 for m in replacements}
    for t in ids:
        if t in placeholder_ids:
            counts[placeholder_ids[t]] += 1
    return counts


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def feature_run(where: str, token_ids: Sequence[int], rng: PlaceholderRange, feature_ids: set[int] | int,
                what: str) -> PlaceholderRange:
    """The one run of feature tokens inside an item's replacement (LLaVA's `<image>` run,
    InternVL's `<IMG_CONTEXT>` run between `<img>` and `</img>`): the rows the model's
    embeddings replace. Families whose spans interleave other tokens keep the whole range."""
    ids = {feature_ids} if isinstance(feature_ids, int) else set(feature_ids)
    rows = [k for k in range(rng.offset, rng.offset + rng.length) if token_ids[k] in ids]
    if not rows or rows[-1] - rows[0] + 1 != len(rows):
        raise ValueError(f"{where}: the processor wrote {what} whose feature tokens are not one run "
                         f"({len(rows)} of {rng.length} tokens); this family expects one run per item")
    return PlaceholderRange(rows[0], len(rows))


def check_feature_rows(where: str, what: str, written: int, expected: int, detail: str = "") -> None:
    """The model's own count for the item against what the processor wrote: a clear error."""
    if written != expected:
        raise ValueError(f"{where}: for {what} the checkpoint's processor expands {written} image tokens but the "
                         f"model produces {expected} features{detail}; the processor config does not match the "
                         "model config")

