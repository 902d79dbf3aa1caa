"""Qwen2-VL and Qwen2.5-VL: transformers' own vision tower (patch embed, 2-D rotary, blocks,
Qwen2.5's window attention, the 2x2 patch merger) + mmkit's paged Qwen2 decoder with M-RoPE.

The vision towers are transformers' modules, run as-is (no KV cache there; the tests check
them against the reference model); the decoder is mmkit's, on the paged cache. Checkpoints load
in the hub's layout (`visual.*`, `model.layers.*`) and the one transformers 5 saves
(`model.visual.*`, `model.language_model.*`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from mmkit.models.interfaces import DecoderLMMixin, ModelCapabilities
from mmkit.models.llama import Linear, pack_linears
from mmkit.models.qwen2 import Qwen2Model
from mmkit.models.registry import ties_word_embeddings
from mmkit.models.weight_utils import load_vlm_checkpoint


class Qwen2VLForConditionalGeneration(DecoderLMMixin, nn.Module):
    """Qwen2-VL (`SupportsMultiModal` of models/interfaces.py); it declares `uses_mrope`:
    positions are M-RoPE rows `[3, num_tokens]` (see models/mrope.py)."""

    supports_multimodal = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.visual = self._vision_class()(config.vision_config)  # the public constructor; cast later
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        text = config.text_config
        # NOTE: M-RoPE positions never exceed the token index except for Qwen2.5-VL video
        # temporal rows (t * tokens_per_second * seconds per grid); the table keeps headroom.
        self.language_model = self._build_decoder(text, 2 * max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)
        # float32 buffers of the tower (rotary inv_freq), kept across the engine's dtype cast.
        self._fp32_buffers = {id(m): {n: b.detach().clone() for n, b in m.named_buffers(recurse=False)
                                      if b.dtype == torch.float32} for m in self.visual.modules()}

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        return replace(super().get_capabilities(hf_config), uses_mrope=True)

    def _build_decoder(self, text, max_positions: int):
        return Qwen2Model(text, max_positions)

    @staticmethod
    def _vision_class():
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel

    # ------------------------------------------------------------------ loading
    def load_checkpoint(self, path: Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> None:
        """Meta parameters (see models/meta_init.py) are created in `dtype` on `device`."""
        load_vlm_checkpoint(self, path, dtype, device)

    def prepare_for_inference(self) -> int:
        """After the final `.to(dtype, device)`: the vision tower's rotary frequencies back to
        float32 (transformers keeps them float32 in a bf16 model; rounded to bf16 they give
        other angles), the decoder's rotary table too, then pre-pack the bf16 CPU matmul weights."""
        self.language_model.rotary.float()
        for module in self.visual.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                fp32 = self._fp32_buffers.get(id(module), {}).get(name)
                if fp32 is not None and buf.dtype != torch.float32:
                    setattr(module, name, fp32.to(buf.device))
        return pack_linears(self.language_model) + pack_linears(self.lm_head)

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Tokens of one image of `image_size` (width, height): its dynamic-resolution patch grid
        (the image processor's smart_resize between its min/max_pixels) merged 2x2."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        merge = hf_config.vision_config.spatial_merge_size
        patch = getattr(image_processor, "patch_size", None) or hf_config.vision_config.patch_size
        size = dict(getattr(image_processor, "size", None) or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        h, w = smart_resize(image_size[1], image_size[0], factor=patch * merge,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return (h // patch) * (w // patch) // merge ** 2

    def embed_multimodal(self, items: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Items (images and videos alike) -> one [num_tokens_i, text_hidden] tensor per item,
        all through one vision-tower call (attention stays within each item).

        items[i]: {"pixel_values": [t*h*w patches, C*temporal_patch*P*P], "grid_thw": [1, 3]}."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        grid = torch.cat([item["grid_thw"] for item in items])
        pixels = torch.cat([item["pixel_values"] for item in items]).to(dtype)
        out = self.visual(pixels, grid_thw=grid)
        merged = out.pooler_output  # [sum of tokens, text_hidden] after the 2x2 merger
        sizes = (grid.prod(-1) // self.spatial_merge_size ** 2).tolist()
        # clone: a cached item must not keep the whole batch's tensor alive
        return [part.clone() for part in torch.split(merged, sizes)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; the tower adds window attention (full attention in
    `fullatt_block_indexes`), RMSNorm and a gated MLP, all in transformers' module."""

    @staticmethod
    def _vision_class():
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel
