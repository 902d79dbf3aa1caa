"""LLaVA-NeXT and LLaVA-OneVision input processing: the number of placeholder tokens of an
image depends on its size (anyres), so it is decided per image when the request is added.

The tokens are what the checkpoint's own HF processor writes for an image of that size
(`processors/replacements.py`), checked against the model's feature count for that size
(`get_num_placeholder_tokens`); a disagreement (e.g. a processor config whose pinpoints or
patch size do not match the model's) is refused loudly, before any request is added, instead
of misaligning embeddings later.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from mmkit.multimodal.inputs import MultiModalKwargs
from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import ProcessedPrompt
from mmkit.processors.llava import BASE_VIEW, LlavaInputProcessor
from mmkit.processors.replacements import Replacement


class LlavaNextInputProcessor(LlavaInputProcessor):
    """`InputProcessor` of LLaVA-NeXT: size-dependent image-token counts, tiles as views."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        if self.probe is None:
            raise ValueError(
                f"model: {model_config.architecture} needs the checkpoint's processor (processor_config.json "
                f"or preprocessor_config.json and the tokenizer files) in {model_config.path!r}"
            )
        # Processor configs saved before these fields existed leave them None; the model config
        # holds the same facts (transformers warns and falls back in the same way).
        hf_config = model_config.hf_config
        vision = hf_config.vision_config
        defaults = {"patch_size": vision.patch_size,
                    "vision_feature_select_strategy": hf_config.vision_feature_select_strategy,
                    "num_image_tokens": (vision.image_size // vision.patch_size) ** 2}
        for name, value in defaults.items():
            if hasattr(self.hf_processor, name) and getattr(self.hf_processor, name) is None:
                setattr(self.hf_processor, name, value)

    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        return super().process(self.choose_layouts(parsed))

    def choose_layouts(self, parsed: ParsedPrompt) -> ParsedPrompt:
        """Hook: OneVision encodes the images of a multi-image prompt differently."""
        return parsed

    def model_rows(self, item: ImageItem, rep: Replacement | None = None) -> int:
        base_only = item.layout == BASE_VIEW
        return self.model_cls.get_num_placeholder_tokens(self.model_config.hf_config, (item.width, item.height),
                                                         self.image_processor, num_views=1 if base_only else None)

    def _check_embeds(self, where: str, embeds) -> None:
        # Any tokens-per-image count is accepted (given embeddings fix their own layout).
        if embeds.shape[-1] != self.model_config.hidden_size:
            raise ValueError(
                f"{where}.multi_modal_data: got image embeddings of shape {tuple(embeds.shape)}; expected "
                f"[N, num_tokens, {self.model_config.hidden_size}] (hidden_size)"
            )

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: ImageItem) -> MultiModalKwargs:
        """{"pixel_values": [num_views, 3, S, S] (base view first, then tiles), "image_sizes": [1, 2]}."""
        image = item.to_pil()
        if item.layout == BASE_VIEW:
            # NOTE: the processor pads an image of a multi-image prompt to a square first; it
            # learns the prompt's image count from the nesting, so pass this one twice.
            out = self.image_processor(images=[[image, image]], return_tensors="pt")
            return {"pixel_values": out["pixel_values"][0][:1], "image_sizes": out["image_sizes"][0]}
        out = self.image_processor(images=[image], return_tensors="pt")
        views = self.model_cls.num_views(self.model_config.hf_config, item.height, item.width)
        return {"pixel_values": out["pixel_values"][0][:views], "image_sizes": out["image_sizes"][0]}


class LlavaOnevisionInputProcessor(LlavaNextInputProcessor):
    """LLaVA-OneVision (images): one image per prompt is tiled (anyres_max); the images of a
    multi-image prompt are each their base view (as transformers does). Video is refused by the
    generic input path (`supported_modalities` is image only)."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        video_token = getattr(self.hf_processor, "video_token", None) or "<video>"
        video_id = self.tokenizer.convert_tokens_to_ids(video_token)
        self.video_token = video_token
        self.video_token_id = video_id if video_id != self.tokenizer.unk_token_id else None

    def choose_layouts(self, parsed: ParsedPrompt) -> ParsedPrompt:
        where = f"inputs[{parsed.index}]"
        if self.video_token_id is not None:
            ids = parsed.prompt_token_ids if parsed.prompt is None else self.tokenizer(parsed.prompt).input_ids
            if self.video_token_id in ids:
                raise ValueError(
                    f"{where}: the prompt holds the video placeholder {self.video_token!r}; video inputs are "
                    f"not supported yet for LlavaOnevisionForConditionalGeneration (expected images only)"
                )
        if len(parsed.images) > 1:
            parsed = replace(parsed, images=[replace(item, layout=BASE_VIEW) for item in parsed.images])
        return parsed
