"""LLaVA input processing with the checkpoint's own HF processor.

Tokenization and placeholder expansion happen when a request is added (cheap, so the whole
call is validated up front); pixel values are computed only when the request is scheduled.
"""

from __future__ import annotations

from typing import Mapping

import torch

from mmkit.inputs import ImageItem, ParsedPrompt
from mmkit.models.interfaces import MultiModalKwargs, PlaceholderRange
from mmkit.models.registry import get_model_class
from mmkit.processors.base import ProcessedPrompt


class LlavaInputProcessor:
    """LLaVA-1.5's `InputProcessor`: `image_seq_length` placeholder tokens per image."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int]) -> None:
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        self.model_config = model_config
        self.image_token_id = model_config.image_token_id
        self.max_images = int(limit_mm_per_prompt.get("image", 8))
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
        self.vocab_size = model_config.vocab_size
        # The model decides how many placeholder tokens an image takes (a constant for LLaVA-1.5).
        model_cls = get_model_class(model_config.architecture)
        self.image_seq_length = model_cls.get_num_placeholder_tokens(model_config.hf_config, (0, 0), image_processor)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.prompt is not None:
            ids = list(self.tokenizer(parsed.prompt).input_ids)
            ids, ranges = self._expand(where, ids, allow_expanded=False)
        else:
            ids = list(parsed.prompt_token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{where}.prompt_token_ids: got token id {bad[0]}; expected ids in [0, {self.vocab_size})"
                )
            ids, ranges = self._expand(where, ids, allow_expanded=True)
        num_images = parsed.num_images
        if num_images > self.max_images:
            raise ValueError(
                f"{where}.multi_modal_data: got {num_images} images; expected at most "
                f"limit_mm_per_prompt['image'] = {self.max_images}"
            )
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

    def _expand(self, where: str, ids: list[int], allow_expanded: bool) -> tuple[list[int], list[PlaceholderRange]]:
        """Expand each image token to `image_seq_length` copies; return ids and ranges."""
        if self.image_token_id is None or self.image_token_id not in ids:
            return ids, []
        n = self.image_seq_length
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
            if allow_expanded and run % n == 0:
                num_images = run // n  # already expanded
            elif run < n or n == 1:
                num_images = run  # one token per image
            else:
                raise ValueError(
                    f"{where}: a run of {run} image tokens (id {self.image_token_id}); expected one "
                    f"token per image or runs of exactly {n} per image"
                )
            for _ in range(num_images):
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
