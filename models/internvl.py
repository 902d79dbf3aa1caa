"""InternVL (the `-HF` checkpoints, e.g. InternVL3.5): InternViT tower (transformers' own
`InternVLVisionModel`) + pixel-unshuffle + MLP projector + mmkit's paged Qwen2 / Qwen3 decoder.

An image is cut by the processor (GotOcr2 image processor, `crop_to_patches`) into T tiles of
`image_size` x `image_size` (plus a thumbnail when T > 1); every tile gives
(image_size / patch)^2 * downsample_ratio^2 embedding rows, so an image's row count is
T * rows_per_tile and depends on its size and on the tiling options.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import torch
from torch import nn
from transformers import AutoModel
from transformers.activations import ACT2FN

from mmkit.models.interfaces import DecoderLMMixin, MultiModalKwargs
from mmkit.models.llama import Linear
from mmkit.models.registry import check_text_model, text_model_class, ties_word_embeddings


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def tokens_per_tile(hf_config: Any) -> int:
    """Embedding rows of one tile: the patch grid shrunk by `downsample_ratio` on each side."""
    vision = hf_config.vision_config
    (ih, iw), (ph, pw) = _pair(vision.image_size), _pair(vision.patch_size)
    return int((ih // ph) * (iw // pw) * hf_config.downsample_ratio ** 2)


class InternVLMultiModalProjector(nn.Module):
    """LayerNorm + Linear + act + Linear over pixel-unshuffled features (HF's parameter names)."""

    def __init__(self, config) -> None:
        super().__init__()
        width = config.vision_config.hidden_size * int(1 / config.downsample_ratio) ** 2
        text_hidden = config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, text_hidden)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(features))))


class InternVLForConditionalGeneration(DecoderLMMixin, nn.Module):
    """InternVL `-HF`: a size- and option-dependent number of tokens per image (`SupportsMultiModal`)."""

    supports_multimodal: ClassVar[bool] = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """The decoder must be one mmkit computes exactly; the tower is InternViT."""
        check_text_model(cls.__name__, hf_config)
        vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
        if vision_type != "internvl_vision":
            raise ValueError(f"model: {cls.__name__} with a {vision_type!r} vision tower is not supported; "
                             "expected 'internvl_vision' (InternViT)")

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        text = config.text_config
        self.language_model = text_model_class(text)(text, max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None, num_tiles: int = 1) -> int:
        """Rows of an image cut into `num_tiles` tiles (the processor decides the tile count)."""
        return num_tiles * tokens_per_tile(hf_config)

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [tiles_i, 3, S, S]} -> one [tiles_i * rows_per_tile, hidden]
        each; the tower runs once over every tile of the call."""
        if not items:
            return []
        dtype = self.vision_tower.dtype  # (the projector's weight may be quantized)
        pixel_values = torch.cat([item["pixel_values"] for item in items]).to(dtype)
        features = self.encode_images(pixel_values)  # [total_tiles, rows_per_tile, hidden]
        per_item = features.split([item["pixel_values"].shape[0] for item in items])
        return [f.reshape(-1, f.shape[-1]) for f in per_item]

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, rows_per_tile, text_hidden]: the configured layer's features
        (CLS dropped for "default"), pixel-unshuffled by transformers' own `pixel_shuffle`
        ([N, s, s, C] -> [N, s*r, s*r, C/r^2]), then projected."""
        from transformers.models.internvl.modeling_internvl import InternVLModel

        layer = self.config.vision_feature_layer
        out = self.vision_tower(pixel_values=pixel_values, output_hidden_states=layer != -1, return_dict=True)
        features = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        n, rows, channels = features.shape
        side = int(rows ** 0.5)
        grid = features.reshape(n, side, side, channels)
        shuffled = InternVLModel.pixel_shuffle(SimpleNamespace(), grid, scale_factor=self.config.downsample_ratio)
        return self.multi_modal_projector(shuffled.reshape(n, -1, shuffled.shape[-1]))
