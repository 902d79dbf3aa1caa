"""LLaVA: vision tower (transformers' own) + projector + mmkit's paged Llama decoder."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Sequence

import torch
from torch import nn
from transformers import AutoModel
from transformers.activations import ACT2FN

from mmkit.models.interfaces import DecoderLMMixin, ModelCapabilities, MultiModalKwargs
from mmkit.models.llama import Linear
from mmkit.models.registry import check_text_model, text_model_class, ties_word_embeddings


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


# HF model_type of vision_config -> a tower transformers' AutoModel builds and mmkit checked.
SUPPORTED_VISION_MODELS = ("clip_vision_model", "siglip_vision_model")


class LlavaForConditionalGeneration(DecoderLMMixin, nn.Module):
    """LLaVA-1.5: a fixed number of tokens per image (`SupportsMultiModal`)."""

    supports_multimodal: ClassVar[bool] = True

    # ------------------------------------------------------------------ declarations
    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """A composite of parts mmkit computes exactly: the decoder and the vision tower."""
        arch = (getattr(hf_config, "architectures", None) or [cls.__name__])[0]
        check_text_model(arch, hf_config)
        vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
        if vision_type not in SUPPORTED_VISION_MODELS:
            raise ValueError(
                f"model: {arch} with a {vision_type!r} vision tower is not supported; supported vision "
                f"towers: {list(SUPPORTED_VISION_MODELS)}"
            )

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        """Every image is resized to the tower's input: a fixed token count."""
        return replace(super().get_capabilities(hf_config), image_seq_length=cls.image_seq_length(hf_config))

    @classmethod
    def image_seq_length(cls, hf_config: Any) -> int:
        """Placeholder tokens per image, the way LlavaProcessor counts them."""
        vision = hf_config.vision_config
        num_patches = (vision.image_size // vision.patch_size) ** 2
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        # CLIP-like towers prepend a CLS token, SigLIP does not; "default" drops the first feature
        # row whatever it is (as transformers does), "full" keeps every row.
        has_cls = getattr(vision, "model_type", "") in ("clip_vision_model", "clip")
        return num_patches + int(has_cls) - int(strategy == "default")

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = text_model_class(config.text_config)(config.text_config, max_positions)
        text = config.text_config
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Every image becomes `image_seq_length` tokens whatever its size (it is resized)."""
        return cls.image_seq_length(hf_config)

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [1, 3, H, W]} -> one [image_seq_length, hidden] each (batched)."""
        if not items:
            return []
        pixel_values = torch.cat([item["pixel_values"] for item in items])
        return list(self.encode_images(pixel_values.to(self.vision_tower.dtype)))

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, image_seq_length, text_hidden] (after the projector)."""
        layer = self.config.vision_feature_layer
        strategy = self.config.vision_feature_select_strategy
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [layer] if isinstance(layer, int) else list(layer)
        feats = [out.hidden_states[i] for i in layers]
        if strategy == "default":
            feats = [f[:, 1:] for f in feats]  # drop CLS
        return self.multi_modal_projector(torch.cat(feats, dim=-1))
