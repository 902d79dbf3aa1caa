"""Idefics3 / SmolVLM input processing with the checkpoint's own processor.

Up front (cheap): each item's span is what the processor writes for it
(`processors/replacements.py`), probed on a blank item of its size (an image with the
request's `do_image_splitting` / `size`; a SmolVLM video at its frame count): every tile as
`<fake_token_around_image><row_i_col_j><image>*N`, the global view last; a video's frame count
in words, then each frame's timestamp and view. A text prompt is expanded by the processor's own
`get_text_with_replacements` and tokenized whole; a token-id prompt gets each placeholder
expanded the same way (or keeps a span already written out). The span's `<image>` count is
checked against the model's rows for the views the processor cut. When scheduled, the same
processor call on the pixels gives `pixel_values [1, views, 3, S, S]` and must write the same
span.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from mmkit.multimodal.inputs import MultiModalKwargs
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.multimodal.video import parse_videos
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.mm_kwargs import BOOL, OptionRule, is_positive_int
from mmkit.processors.replacements import (ReplacementProbe, call_processor, check_feature_rows, expand_text,
                                           expand_token_ids)
from mmkit.processors.span_embeds_input import GivenSpanItem, given_item_inputs, given_span_embeds, sized_or_one_view
from mmkit.processors.spans import SpanItem, check_text_placeholders, checked_token_ids


# Per-request processor options (vLLM's `mm_processor_kwargs`), applied to images.
def _is_longest_edge(size: Any) -> bool:
    return isinstance(size, Mapping) and list(size) == ["longest_edge"] and is_positive_int(size["longest_edge"])


ALLOWED_MM_PROCESSOR_KWARGS = {"do_image_splitting": BOOL,
                               "size": OptionRule(_is_longest_edge, "{'longest_edge': <positive int>}")}


class VideosPerPrompt:
    """The checkpoint's processor, given each prompt's videos as a list (`videos=[[frames]]`):
    the one form every SmolVLMProcessor reads as one video (5.17 reads `[frames]` as several
    one-frame videos); everything else is the processor's own."""

    def __init__(self, hf_processor: Any) -> None:
        self.hf_processor = hf_processor

    def __getattr__(self, name: str) -> Any:
        if name == "hf_processor":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.hf_processor, name)

    def __call__(self, *args: Any, videos: Any = None, **kwargs: Any) -> Any:
        return self.hf_processor(*args, videos=None if videos is None else [videos], **kwargs)


class Idefics3InputProcessor(BaseInputProcessor):
    """`InputProcessor` of Idefics3 (images); `SmolVLMInputProcessor` adds video."""

    mm_processor_rules = ALLOWED_MM_PROCESSOR_KWARGS
    mm_processor_example = "{'do_image_splitting': False}"

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from mmkit.models.registry import get_model_class

        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        self.model_cls = get_model_class(self.name)
        hf = self.load_hf_processor(tokenizer_path)
        self.video_processor = getattr(self, "video_processor", None)  # image-only Idefics3: none
        if self.video_processor is not None:
            self.hf_processor = VideosPerPrompt(hf)
        self.image_token_id = model_config.hf_config.image_token_id
        self.placeholders = {"image": hf.image_token}
        if self.video_processor is not None:
            self.placeholders["video"] = hf.video_token
        image_id = self.tokenizer.convert_tokens_to_ids(hf.image_token)
        if image_id != self.image_token_id:
            raise ValueError(f"model: the processor's image token {hf.image_token!r} has id "
                             f"{image_id}; the model config's image_token_id is {self.image_token_id}")
        self.image_seq_len = self.model_cls.image_seq_len(model_config.hf_config)
        if hf.image_seq_len != self.image_seq_len:
            raise ValueError(f"model: the processor writes image_seq_len = {hf.image_seq_len} tokens per view; the "
                             f"model's pixel shuffle gives {self.image_seq_len}")
        self.probe = ReplacementProbe(self.hf_processor)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        options = self.request_options(where, parsed)
        given = None
        if parsed.image_embeds is not None:
            given = given_span_embeds(where, parsed, name=self.name, hidden_size=self.model_config.hidden_size,
                                      max_images=self.max_items["image"], image_token_id=self.image_token_id,
                                      tokenizer=self.tokenizer,
                                      replacement=sized_or_one_view(self.probe, options, {"do_image_splitting": False}))
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
        num_given = len(given) if given is not None else 0
        given_reps, given = given, {"image": [[image] for image in parsed.images], "video": videos}
        if given_reps is not None:  # placeholders for the count check; their spans come from the sizes
            given["image"] = [[None]] * num_given
        self.check_item_counts(where, {m: len(items) for m, items in given.items()})
        wheres = {m: [f"{where}.multi_modal_data.{m}[{k}]" for k in range(len(given[m]))] for m in self.placeholders}
        used = {"image": options, "video": {}}  # the request's options apply to images
        if parsed.prompt is not None:  # the count first: a clear error before any processor call
            check_text_placeholders(where, parsed.prompt, self.placeholders, {m: len(given[m]) for m in given})
        reps = {m: [self.probe.replacement(m, frames[0].width, frames[0].height, len(frames), used[m], w)
                    for frames, w in zip(given[m], wheres[m])] if m != "image" or given_reps is None
                    else [g.rep for g in given_reps] for m in self.placeholders}
        if parsed.prompt is not None:
            exp = expand_text(self.hf_processor, self.tokenizer, where, parsed.prompt, reps)
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            exp = expand_token_ids(self.hf_processor, self.tokenizer, where, ids, reps)
        items = []
        for (m, k), rng in zip(exp.order, exp.ranges):
            if m == "image" and given_reps is not None:  # its rows were checked against the span
                items.append(GivenSpanItem("image", [], exp.token_ids[rng.offset:rng.offset + rng.length],
                                           dict(options), where=wheres[m][k], embeds=given_reps[k].embeds,
                                           size=given_reps[k].size))
                continue
            item = SpanItem(m, list(given[m][k]), exp.token_ids[rng.offset:rng.offset + rng.length], dict(used[m]),
                            where=wheres[m][k])
            self._check_span(item, reps[m][k].outputs)
            items.append(item)
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=exp.token_ids,
                               placeholder_ranges=exp.ranges, images=items, mm_processor_kwargs=options)

    def _check_span(self, item: SpanItem, outputs: Mapping[str, Any]) -> None:
        """The span's image tokens must be the model's feature rows: image_seq_len per view the
        processor cut (an image's tiles and global view; a video's frames)."""
        views = int(outputs["pixel_values_shape"][1])  # [1, views, 3, S, S]
        frame = item.frames[0]
        what = (f"an image of {frame.width}x{frame.height}" if item.modality == "image"
                else f"a video of {len(item.frames)} frames")
        check_feature_rows(item.where, what, sum(1 for t in item.span_ids if t == self.image_token_id),
                           self.image_seq_len * views, f" ({views} views)")

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """{"pixel_values": [1, views, 3, S, S], "pixel_attention_mask": [1, views, S, S], "span_ids": [L]}
        (given embeddings: {"image_embeds": [views * image_seq_len, hidden], "span_ids": [L]})."""
        if isinstance(item, GivenSpanItem):
            return given_item_inputs(item)
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        rep, out = call_processor(self.hf_processor, item.modality, frames, item.options, item.where)
        predicted = self.probe.replacement(item.modality, frames[0].width, frames[0].height, len(frames),
                                           item.options, item.where)
        if rep.text != predicted.text:
            raise ValueError(f"{item.where}: the processor wrote a different span for the {item.modality}'s pixels "
                             f"({rep.outputs['pixel_values_shape'][1]} views) than for its size "
                             f"({predicted.outputs['pixel_values_shape'][1]} views); refusing to misalign the "
                             "placeholders")
        return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"],
                "span_ids": torch.tensor(item.span_ids, dtype=torch.long)}


class SmolVLMInputProcessor(Idefics3InputProcessor):
    """SmolVLM / SmolVLM2: Idefics3's image layout, and video (its frame prompt)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")
