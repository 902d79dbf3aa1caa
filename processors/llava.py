"""LLaVA input processing with the checkpoint's own HF processor.

Tokenization and placeholder expansion happen when a request is added (cheap, so the whole
call is validated up front); pixel values are computed only when the request is scheduled.
What an image's placeholder becomes is what the checkpoint's processor writes for it
(`processors/replacements.py`); the model's own count of embedding rows is checked against it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mmkit.models.registry import get_model_class
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.replacements import (Replacement, ReplacementProbe, check_feature_rows, count_tokens,
                                           expand_text, feature_run)

# ImageItem.layout of an image that is encoded as its base view alone (OneVision, multi-image).
BASE_VIEW = "base_view"


class LlavaInputProcessor(BaseInputProcessor):
    """LLaVA-1.5's `InputProcessor`: `image_seq_length` placeholder tokens per image."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        self.image_token_id = model_config.image_token_id
        # NOTE: not `load_hf_processor`: LLaVA checkpoints saved before processor configs
        # existed carry a tokenizer and an image processor only.
        try:
            processor = AutoProcessor.from_pretrained(tokenizer_path, local_files_only=True)
        except Exception:  # noqa: BLE001 - older checkpoints ship no processor config
            processor = None
        tokenizer = getattr(processor, "tokenizer", None)
        image_processor = getattr(processor, "image_processor", None)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        if image_processor is None:
            image_processor = AutoImageProcessor.from_pretrained(model_config.path, local_files_only=True)
        self.hf_processor = processor
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        # The model decides how many placeholder tokens an image takes (a constant for LLaVA-1.5;
        # size-dependent for anyres families, whose processors override `image_token_counts`).
        self.model_cls = get_model_class(model_config.architecture)
        self.image_seq_length = model_config.capabilities.image_seq_length
        # Checkpoints saved without a processor config fall back to the model's own count.
        self.probe = ReplacementProbe(processor) if getattr(processor, "image_token", None) else None

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.image_embeds_fields:
            raise ValueError(f"{where}.multi_modal_data: got image embeddings with {sorted(parsed.image_embeds_fields)}; "
                             f"{self.model_config.architecture} takes a tensor [N, tokens, hidden_size] only")
        self.request_options(where, parsed)  # refuses options LLaVA does not take (subclasses apply theirs)
        if parsed.prompt is not None and parsed.image_embeds is None and parsed.num_images and self.probe:
            # The processor's own expansion of the text; each image's range is its feature run.
            reps = self.image_replacements(where, parsed)
            exp = expand_text(self.hf_processor, self.tokenizer, where, parsed.prompt, {"image": reps})
            ids = exp.token_ids
            ranges = [feature_run(where, ids, rng, self.image_token_id, "an image") for rng in exp.ranges]
        elif parsed.prompt is not None:
            ids = list(self.tokenizer(parsed.prompt).input_ids)
            ids, ranges = self._expand(where, ids, self.image_token_counts(where, parsed), allow_expanded=False)
        else:
            ids = list(parsed.prompt_token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{where}.prompt_token_ids: got token id {bad[0]}; expected ids in [0, {self.vocab_size})"
                )
            ids, ranges = self._expand(where, ids, self.image_token_counts(where, parsed), allow_expanded=True)
        num_images = parsed.num_images
        self.check_item_counts(where, {"image": num_images})
        if len(ranges) != num_images:
            raise ValueError(
                f"{where}: the prompt has {len(ranges)} image placeholder(s) but {num_images} image(s) "
                f"were given; expected one placeholder ({self._placeholder_name()}) per image"
            )
        if parsed.image_embeds is not None:
            self._check_embeds(where, parsed.image_embeds)
        return ProcessedPrompt(
            index=parsed.index,
            prompt=parsed.prompt,
            prompt_token_ids=ids,
            placeholder_ranges=ranges,
            images=list(parsed.images),
            image_embeds=parsed.image_embeds,
        )

    def _placeholder_name(self) -> str:
        return getattr(self.hf_processor, "image_token", None) or "<image>"

    def image_token_counts(self, where: str, parsed: ParsedPrompt) -> list[int]:
        """Feature tokens of each given image, in order: given embeddings fix their own count;
        otherwise what the processor writes (checked against the model's rows)."""
        if parsed.image_embeds is not None:
            return [int(parsed.image_embeds.shape[1])] * parsed.num_images
        if self.probe is None:
            return [self.model_rows(item) for item in parsed.images]
        return [count_tokens(self.tokenizer, rep.text, self.image_token_id)
                for rep in self.image_replacements(where, parsed)]

    def image_replacements(self, where: str, parsed: ParsedPrompt) -> list[Replacement]:
        """What the processor writes for each image, each checked against the model's rows."""
        reps = []
        for i, item in enumerate(parsed.images):
            at = f"{where}.multi_modal_data[{i}]"
            rep = self.probe.replacement("image", item.width, item.height, 1, self.processor_kwargs(item), at,
                                         in_multi_image_prompt=item.layout == BASE_VIEW)
            check_feature_rows(at, f"an image of {item.width}x{item.height}",
                               count_tokens(self.tokenizer, rep.text, self.image_token_id),
                               self.model_rows(item, rep))
            reps.append(rep)
        return reps

    def processor_kwargs(self, item: ImageItem) -> dict[str, Any]:
        """The processor options an image is processed with (InternVL: its tiling)."""
        return {}

    def model_rows(self, item: ImageItem, rep: Replacement | None = None) -> int:
        """The embedding rows the model produces for the image (LLaVA-1.5: the same for all)."""
        return self.model_cls.get_num_placeholder_tokens(self.model_config.hf_config, (item.width, item.height),
                                                         self.image_processor)

    def _expand(self, where: str, ids: list[int], counts: list[int],
                allow_expanded: bool) -> tuple[list[int], list[PlaceholderRange]]:
        """Expand the i-th image placeholder to `counts[i]` tokens; return ids and ranges.

        A token-id prompt may hold a run of k placeholders for k images, or (allow_expanded)
        the runs already expanded: exactly `counts[i] + counts[i+1] + ...` tokens."""
        if self.image_token_id is None or self.image_token_id not in ids:
            return ids, []
        out: list[int] = []
        ranges: list[PlaceholderRange] = []
        i = 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                out.append(ids[i])
                i += 1
                continue
            run = 1
            while i + run < len(ids) and ids[i + run] == self.image_token_id:
                run += 1
            image = len(ranges)
            first = counts[image] if image < len(counts) else None
            num_images = _num_expanded_images(run, counts[image:]) if allow_expanded else None
            if num_images is None:
                if first is not None and 1 < first <= run:
                    raise ValueError(
                        f"{where}: a run of {run} image tokens (id {self.image_token_id}); expected one token "
                        f"per image or, per image, a run of exactly its number of image tokens "
                        f"(image {image}: {first})"
                    )
                num_images = run  # one token per image
            for k in range(image, image + num_images):
                # Placeholders beyond the given images keep one token; the count check after
                # expansion reports the mismatch.
                n = counts[k] if k < len(counts) else 1
                ranges.append(PlaceholderRange(len(out), n))
                out.extend([self.image_token_id] * n)
            i += run
        return out, ranges

    def _check_embeds(self, where: str, embeds: torch.Tensor) -> None:
        expected = (self.image_seq_length, self.model_config.hidden_size)
        if tuple(embeds.shape[1:]) != expected:
            raise ValueError(
                f"{where}.multi_modal_data: got image embeddings of shape {tuple(embeds.shape)}; expected "
                f"[N, {expected[0]}, {expected[1]}] (image_seq_length, hidden_size)"
            )

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: ImageItem) -> MultiModalKwargs:
        return {"pixel_values": self.pixel_values([item])}  # [1, 3, H, W]

    def pixel_values(self, images: list[ImageItem]) -> torch.Tensor:
        """Raw images -> normalized pixel values [N, 3, H, W] (HF image processor)."""
        pil_images = [item.to_pil() for item in images]
        out = self.image_processor(images=pil_images, return_tensors="pt")
        return out["pixel_values"]


def _num_expanded_images(run: int, counts: list[int]) -> int | None:
    """How many of the next images (with these token counts) an already expanded run of
    `run` tokens covers, or None if it is not a whole number of them."""
    total = 0
    for k, n in enumerate(counts):
        total += n
        if total >= run:
            return k + 1 if total == run else None
    return None
