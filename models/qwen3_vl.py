"""Qwen3-VL and Qwen3-VL-MoE: transformers' own vision tower (patch 16, learned position grid,
2x2 merger, DeepStack mergers) + mmkit's paged Qwen3 decoder with interleaved M-RoPE.

DeepStack: the tower also merges the hidden states of `deepstack_visual_indexes` layers; these
L feature sets are added to the decoder's hidden states after its first L layers, at the item's
rows. mmkit carries them as extra columns of the item embedding, vLLM's layout: one item is
`[num_tokens, (1 + L) * hidden]` (declared as `ModelCapabilities.deepstack_num_layers`, see
models/interfaces.py), so the encoder cache, chunked prefill, prefix-cache hits and preemption
move them exactly as they move the embedding; text rows of a step carry zeros there (adding zero changes nothing).

A video is one item whose placeholder range is its whole expansion as transformers writes it,
`<t seconds><|vision_start|>` + frame tokens + `<|vision_end|>` per temporal patch: the item's
rows for those timestamp / delimiter tokens are their token embeddings (`span_token_ids`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Sequence

import torch

from mmkit.layers.rotary import RotaryEmbedding
from mmkit.models.interfaces import ModelCapabilities
from mmkit.models.qwen2_vl import Qwen2VLForConditionalGeneration
from mmkit.models.qwen3 import Qwen3Model, Qwen3MoeModel

_DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' default when the config names none


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """`SupportsMultiModal`; it declares `uses_mrope` and one DeepStack layer per
    `deepstack_visual_indexes` entry (item rows `(1 + L) * hidden` wide)."""

    decoder_cls: ClassVar[type] = Qwen3Model

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        return replace(super().get_capabilities(hf_config), deepstack_num_layers=cls.deepstack_layers(hf_config))

    @classmethod
    def deepstack_layers(cls, hf_config: Any) -> int:
        """One DeepStack feature set per `deepstack_visual_indexes` entry of the tower."""
        return len(hf_config.vision_config.deepstack_visual_indexes)

    def _build_decoder(self, text, max_positions: int):
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        rotary = RotaryEmbedding(text, max_positions, rope.get("mrope_section") or _DEFAULT_MROPE_SECTION,
                                 mrope_interleaved=True)  # transformers interleaves whatever the flag says
        return self.decoder_cls(text, max_positions, rotary)

    @staticmethod
    def _vision_class():
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def embed_multimodal(self, items: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """items[i]: {"pixel_values", "grid_thw" [1, 3]} (+ "span_token_ids" [n], "span_vision"
        [n] bool for a video) -> [n_i, (1 + L) * hidden]: merged features, then L DeepStack sets."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        grid = torch.cat([item["grid_thw"] for item in items])
        pixels = torch.cat([item["pixel_values"] for item in items]).to(dtype)
        out = self.visual(pixels, grid_thw=grid)
        rows = self._feature_rows(out)  # [sum tokens, (1+L)*H]
        sizes = (grid.prod(-1) // self.spatial_merge_size ** 2).tolist()
        result = []
        for item, part in zip(items, torch.split(rows, sizes)):
            span = item.get("span_token_ids")
            if span is None:
                result.append(part.clone())  # a cached item must not keep the batch's tensor alive
                continue
            vision = item["span_vision"].to(part.device)
            full = part.new_zeros(span.shape[0], part.shape[1])
            hidden = self.config.text_config.hidden_size
            full[:, :hidden] = self.language_model.embed_tokens(span.to(part.device)).to(part.dtype)
            full[vision] = part
            result.append(full)
        return result

    def _feature_rows(self, out: Any) -> torch.Tensor:
        """The tower's output as item rows: merged features, then the DeepStack sets."""
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        # inputs_embeds: [T, hidden], or [T, (1 + L) * hidden] when the step merged items
        hidden = self.config.text_config.hidden_size
        deepstack = None
        if inputs_embeds.shape[1] > hidden:
            deepstack = inputs_embeds[:, hidden:].reshape(inputs_embeds.shape[0], -1, hidden)
            inputs_embeds = inputs_embeds[:, :hidden].contiguous()
        return self.language_model(inputs_embeds, positions, kv_caches, meta, deepstack)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: the same tower; experts in the decoder layers transformers makes sparse."""

    decoder_cls = Qwen3MoeModel
