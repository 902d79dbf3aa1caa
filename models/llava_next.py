"""LLaVA-NeXT (1.6) and LLaVA-OneVision: LLaVA with anyres tiling.

An image becomes a base view plus the tiles of the `image_grid_pinpoints` resolution that
fits it best; the tiles' features are stitched into one map, unpadded back to the image's
aspect ratio, and every row of it ends with the learned `image_newline` embedding. The
number of tokens therefore depends on the image size. The stitching is transformers' own
`pack_image_features` (called on mmkit's modules), so the layout is the reference one by
construction; mmkit batches the vision tower over every tile of a step.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from mmkit.models.interfaces import MultiModalKwargs
from mmkit.models.llava import LlavaForConditionalGeneration


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: anyres tiles + base view, unpadded, one `image_newline` per feature row."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))

    # ------------------------------------------------------------------ token layout
    @classmethod
    def pack_features(cls, hf_config: Any, features: Sequence[torch.Tensor], image_sizes: Sequence[Any],
                      image_newline: torch.Tensor) -> list[torch.Tensor]:
        """Per image [num_views, patches_per_view, hidden] -> [num_tokens, hidden] (HF's code)."""
        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

        owner = SimpleNamespace(config=hf_config)
        packed, _ = LlavaNextModel.pack_image_features(owner, list(features), image_sizes,
                                                       hf_config.vision_feature_select_strategy, image_newline)
        return packed

    @classmethod
    def num_views(cls, hf_config: Any, height: int, width: int) -> int:
        """Base view + tiles for an image of this size (what the image processor produces)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return image_size_to_num_patches((height, width), hf_config.image_grid_pinpoints,
                                         hf_config.vision_config.image_size)

    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None, num_views: int | None = None) -> int:
        """The model's feature count for an image of `image_size` (width, height): the same
        packing run on meta tensors (no compute). `num_views=1` is the base view alone."""
        width, height = image_size
        vision = hf_config.vision_config
        side = vision.image_size // vision.patch_size
        views = num_views or cls.num_views(hf_config, height, width)
        meta = torch.empty(views, side * side, 1, device="meta")
        packed = cls.pack_features(hf_config, [meta], [(height, width)], torch.empty(1, device="meta"))
        return int(packed[0].shape[0])

    # ------------------------------------------------------------------ encoding
    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [num_views, 3, S, S], "image_sizes": [1, 2] (height, width)}
        -> one [num_tokens_i, hidden] each; the tower runs once over every view of the call."""
        if not items:
            return []
        dtype = self.vision_tower.dtype  # (the projector's weight may be quantized)
        pixel_values = torch.cat([item["pixel_values"] for item in items]).to(dtype)
        features = self.encode_images(pixel_values)  # [total_views, patches_per_view, hidden]
        per_item = features.split([item["pixel_values"].shape[0] for item in items])
        sizes = [item["image_sizes"].reshape(2).tolist() for item in items]
        return self.pack_features(self.config, per_item, sizes, self.image_newline)


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """LLaVA-OneVision (images): anyres_max (the unpadded map is shrunk to at most N tiles'
    worth of features); an image of a multi-image prompt is its base view alone."""

    is_onevision: ClassVar[bool] = True

    @classmethod
    def pack_features(cls, hf_config: Any, features: Sequence[torch.Tensor], image_sizes: Sequence[Any],
                      image_newline: torch.Tensor) -> list[torch.Tensor]:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        owner = SimpleNamespace(config=hf_config)
        packed, _ = LlavaOnevisionModel.pack_image_features(
            owner, list(features), image_sizes, image_newline=image_newline,
            vision_aspect_ratio=getattr(hf_config, "vision_aspect_ratio", "anyres_max_9"))
        return packed
