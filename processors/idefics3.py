"""Idefics3 / SmolVLM input processing with the checkpoint's own processor.

Up front (cheap): each image's tile grid from the image processor's own
`get_number_of_image_patches` (per-request `do_image_splitting` and `size`), its text from the
processor's own `replace_image_token`, a SmolVLM video's text (frame count in words,
timestamps, one global view per frame) from `replace_video_token`; a text prompt is then
tokenized as transformers tokenizes it (placeholders replaced in the text) and each item's
span found by its characters, as the HF processor does. A token-id prompt gets each span's
tokens spliced in at its placeholder token. When scheduled: the HF image / video processor
gives the views (`[1, views, 3, S, S]`), which must match the prediction.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.mm_kwargs import BOOL, OptionRule, is_positive_int
from mmkit.processors.mm_kwargs import check_mm_processor_kwargs as check_options
from mmkit.processors.spans import SpanItem, checked_token_ids, count_error, expand_spans
from mmkit.multimodal.video import parse_videos

# Per-request processor options (vLLM's `mm_processor_kwargs`), applied to images.
def _is_longest_edge(size: Any) -> bool:
    return isinstance(size, Mapping) and list(size) == ["longest_edge"] and is_positive_int(size["longest_edge"])


ALLOWED_MM_PROCESSOR_KWARGS = {"do_image_splitting": BOOL,
                               "size": OptionRule(_is_longest_edge, "{'longest_edge': <positive int>}")}


def check_mm_processor_kwargs(where: str, kwargs: Any) -> dict[str, Any]:
    return check_options(where, kwargs, ALLOWED_MM_PROCESSOR_KWARGS, "{'do_image_splitting': False}")


class Idefics3InputProcessor:
    """`InputProcessor` of Idefics3 (images); `SmolVLMInputProcessor` adds video."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        from mmkit.models.registry import get_model_class

        self.name = model_config.architecture
        self.model_config = model_config
        self.model_cls = get_model_class(self.name)
        hf = self.hf_processor = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        self.tokenizer = hf.tokenizer
        self.image_processor = hf.image_processor
        self.video_processor = getattr(hf, "video_processor", None) if "video" in self.supported_modalities else None
        self.chat_template = getattr(hf, "chat_template", None)
        self.vocab_size = model_config.vocab_size
        self.image_token_id = model_config.hf_config.image_token_id
        self.placeholders = {"image": hf.image_token}
        if self.video_processor is not None:
            self.placeholders["video"] = hf.video_token
        self.placeholder_ids = {m: self.tokenizer.convert_tokens_to_ids(t) for m, t in self.placeholders.items()}
        if self.placeholder_ids["image"] != self.image_token_id:
            raise ValueError(f"model: the processor's image token {hf.image_token!r} has id "
                             f"{self.placeholder_ids['image']}; the model config's image_token_id is {self.image_token_id}")
        self.image_seq_len = self.model_cls.image_seq_len(model_config.hf_config)
        if hf.image_seq_len != self.image_seq_len:
            raise ValueError(f"model: the processor writes image_seq_len = {hf.image_seq_len} tokens per view; the "
                             f"model's pixel shuffle gives {self.image_seq_len}")
        self.max_items = {m: int(limit_mm_per_prompt.get(m, 8 if m == "image" else 1)) for m in ("image", "video")}
        self.default_kwargs = check_mm_processor_kwargs("mm_processor_kwargs", mm_processor_kwargs)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.image_embeds is not None:
            raise ValueError(f"{where}.multi_modal_data: image embeddings are not supported for {self.name}; "
                             "pass images")
        options = {**self.default_kwargs,
                   **check_mm_processor_kwargs(f"{where}.mm_processor_kwargs", parsed.mm_processor_kwargs)}
        videos = []
        if parsed.video_data is not None:
            if self.video_processor is None:  # a SmolVLM checkpoint saved without its video processor
                raise ValueError(f"{where}.multi_modal_data: got a 'video'; this checkpoint's processor has no "
                                 "video processor")
            if getattr(self.video_processor, "do_sample_frames", False):
                # NOTE: transformers refuses to sample given frames without their frame rate too.
                raise ValueError(f"{where}.multi_modal_data['video']: this checkpoint's video processor samples "
                                 "frames (do_sample_frames=True), which needs the source video's frame rate; mmkit "
                                 "takes the frames as given: pass the frames to use and set do_sample_frames to "
                                 "false in the checkpoint's processor config")
            videos = parse_videos(f"{where}.multi_modal_data['video']", parsed.video_data)
        given = {"image": list(parsed.images), "video": videos}
        for modality, items in given.items():
            if len(items) > self.max_items[modality]:
                raise ValueError(f"{where}.multi_modal_data: got {len(items)} {modality}s; expected at most "
                                 f"limit_mm_per_prompt['{modality}'] = {self.max_items[modality]}")
        texts = {"image": [self._image_text(f"{where}.multi_modal_data.image[{i}]", im, options)
                           for i, im in enumerate(given["image"])],
                 "video": [self._video_text(frames) for frames in videos]}
        if parsed.prompt is not None:
            ids, ranges, items = self._expand_text(where, parsed.prompt, given, texts, options)
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            items = self._items_in_order(where, ids, given, texts, options)
            ids, ranges = expand_spans(where, ids, self.placeholder_ids, items, allow_expanded=True)
        for item in items:
            self._check_span(item)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=ids,
                               placeholder_ranges=ranges, images=items, mm_processor_kwargs=options)

    def _grid(self, image: ImageItem, options: dict) -> tuple[int, int]:
        _, rows, cols = self.image_processor.get_number_of_image_patches(image.height, image.width, options)
        return rows, cols

    def _image_text(self, where: str, image: ImageItem, options: dict) -> str:
        rows, cols = self._grid(image, options)
        return self.hf_processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)

    def _video_text(self, frames: list[ImageItem]) -> str:
        """SmolVLM's own video prompt for these frames, as it writes it for frames given
        without metadata (every frame kept, timestamps at the processor's default rate)."""
        from transformers.video_utils import VideoMetadata

        n = len(frames)
        metadata = VideoMetadata(total_num_frames=n, fps=None, duration=None, frames_indices=list(range(n)),
                                 height=frames[0].height, width=frames[0].width)
        shape_only = torch.empty(1, n, 0)  # the processor reads the frame count from dim 1
        return self.hf_processor.replace_video_token({"pixel_values": shape_only, "video_metadata": [metadata]}, 0)

    def _expand_text(self, where: str, prompt: str, given: dict, texts: dict, options: dict):
        """Placeholders replaced in the text, the text tokenized whole, each item's span found
        from its characters (transformers' own way: the tokens match its processor's)."""
        found = sorted((pos, m) for m, token in self.placeholders.items() for pos in _find_all(prompt, token))
        counts = {m: sum(1 for _, mm in found if mm == m) for m in self.placeholders}
        if any(counts[m] != len(given[m]) for m in self.placeholders):
            parts = [f"{counts[m]} {self.placeholders[m]} placeholder(s) for {len(given[m])} {m}(s)"
                     for m in self.placeholders if counts[m] or given[m]]
            raise ValueError(f"{where}: the prompt has " + " and ".join(parts) + "; expected one placeholder per item")
        pieces, spans, order, cursor, next_index = [], [], [], 0, {"image": 0, "video": 0}
        length = 0
        for pos, modality in found:
            pieces.append(prompt[cursor:pos])
            length += pos - cursor
            k = next_index[modality]
            next_index[modality] += 1
            text = texts[modality][k]
            spans.append((length, length + len(text)))
            order.append((modality, k))
            pieces.append(text)
            length += len(text)
            cursor = pos + len(self.placeholders[modality])
        pieces.append(prompt[cursor:])
        encoding = self.tokenizer("".join(pieces))
        ids = list(encoding.input_ids)
        ranges, items = [], []
        for (start, end), (modality, k) in zip(spans, order):
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if ranges and first < ranges[-1].offset + ranges[-1].length:  # pragma: no cover - special-token bounds
                raise ValueError(f"{where}: two placeholders share a token; separate them")
            ranges.append(PlaceholderRange(first, last - first + 1))
            items.append(self._item(where, modality, k, given, ids[first:last + 1], options))
        return ids, ranges, items

    def _items_in_order(self, where: str, ids: list[int], given: dict, texts: dict, options: dict) -> list[SpanItem]:
        """A token-id prompt's items in the order their placeholder tokens (or spans already
        written out in full) appear; each span is the tokens of the processor's text for it."""
        spans = {m: [list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in texts[m]] for m in texts}
        items, next_index, i = [], {"image": 0, "video": 0}, 0
        while i < len(ids):
            step = 1
            for modality, tid in self.placeholder_ids.items():
                k = next_index[modality]
                if k >= len(given[modality]):
                    continue
                span = spans[modality][k]
                if ids[i] == tid or ids[i:i + len(span)] == span:
                    step = len(span) if ids[i:i + len(span)] == span else 1
                    items.append(self._item(where, modality, k, given, span, options))
                    next_index[modality] += 1
                    break
            i += step
        if any(next_index[m] != len(given[m]) for m in self.placeholders):
            wanted = [SpanItem(m, [], []) for m in self.placeholders for _ in given[m]]
            raise ValueError(count_error(where, ids, self.placeholder_ids, wanted))
        return items

    def _item(self, where: str, modality: str, k: int, given: dict, span: list[int], options: dict) -> SpanItem:
        frames = given[modality][k] if modality == "video" else [given[modality][k]]
        used = dict(options) if modality == "image" else {}
        return SpanItem(modality, list(frames), span, used, where=f"{where}.multi_modal_data.{modality}[{k}]")

    def _check_span(self, item: SpanItem) -> None:
        """The span's image tokens must be the model's feature rows for the item."""
        if item.modality == "image":
            rows, cols = self._grid(item.frames[0], item.options)
            expected = self.image_seq_len * (rows * cols + 1)
        else:
            expected = self.image_seq_len * len(item.frames)
        got = sum(1 for t in item.span_ids if t == self.image_token_id)
        if got != expected:
            raise ValueError(f"{item.where}: the processor's text holds {got} image tokens but the model produces "
                             f"{expected} features for it; refusing to misalign them")

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [1, views, 3, S, S], "pixel_attention_mask": [1, views, S, S], "span_ids": [L]}."""
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        if item.modality == "image":
            out = self.image_processor(images=[frames], return_tensors="pt", **item.options)
            rows, cols = self._grid(item.frames[0], item.options)
            views = rows * cols + 1
        else:
            out = self.video_processor(videos=[frames], return_tensors="pt")
            views = len(frames)
        pixels = out["pixel_values"]
        if pixels.shape[1] != views:
            raise ValueError(f"{item.where}: the processor produced {pixels.shape[1]} views where {views} were "
                             "predicted; refusing to misalign the placeholders")
        return {"pixel_values": pixels, "pixel_attention_mask": out["pixel_attention_mask"],
                "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}


class SmolVLMInputProcessor(Idefics3InputProcessor):
    """SmolVLM / SmolVLM2: Idefics3's image layout, and video (its frame prompt)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")


def _find_all(text: str, token: str) -> list[int]:
    positions, start = [], text.find(token)
    while start != -1:
        positions.append(start)
        start = text.find(token, start + len(token))
    return positions
