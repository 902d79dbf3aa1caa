"""LFM2-VL: transformers' SigLIP2 NaFlex tower and LFM2-VL projector (pixel unshuffle, LayerNorm,
two linears) + mmkit's LFM2 decoder, a hybrid of short-convolution and attention layers.

- Convolution layers (`conv`): `in_proj` gives B, C, x; the short causal convolution (kernel
  `conv_L_cache`, no activation) runs over B * x and its output is gated by C, then `out_proj`.
  Each request keeps the last K-1 inputs of every such layer in a state slot
  (mmkit/worker/state_cache.py; its `ModelCapabilities.state_spec`), no KV.
- Attention layers: q/k RMS-normalised per head (`q_layernorm` / `k_layernorm`), full rotary,
  paged attention, `out_proj`.
- Pre-norm blocks (`operator_norm`, `ffn_norm`), a SwiGLU `feed_forward` (w1, w3, w2), the final
  `embedding_norm`.

An image is one item whose span is everything the processor writes for it
(`<|image_start|>` ... `<|image_end|>`, with `<|img_row_i_col_j|>` before each tile and
`<|img_thumbnail|>` before the thumbnail); its rows are the span's token embeddings with the
features of its views (tiles, then thumbnail, as transformers' `get_image_features` returns
them) in the `<image>` rows (models/span_embeds.py).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmkit.layers.attention import AttentionMetadata, paged_attention
from mmkit.layers.norms import RMSNorm
from mmkit.layers.rotary import RotaryEmbedding, StepRope
from mmkit.layers.short_conv import causal_conv_chunk, causal_conv_step
from mmkit.layers.state_spec import StateSpec
from mmkit.models.interfaces import DecoderLMMixin, ModelCapabilities, MultiModalKwargs
from mmkit.models.llama import Linear
from mmkit.models.registry import ties_word_embeddings
from mmkit.models.span_embeds import span_embeddings

CONV = "conv"


class ShortConv(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, bias = config.hidden_size, bool(config.conv_bias)
        self.hidden_size = hidden
        self.conv = nn.Conv1d(hidden, hidden, config.conv_L_cache, groups=hidden, bias=bias)  # [H, 1, K]
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = meta.state_batch
        gate_b, gate_c, h = self.in_proj(x).split(self.hidden_size, dim=-1)  # [T, H] each
        bx = gate_b * h
        windows, _ = batch.cache.layer(self.layer_idx)
        weight, bias = self.conv.weight[:, 0], self.conv.bias
        conv = torch.empty_like(bx)
        num_decodes = batch.num_decodes
        if num_decodes:
            slots = batch.decode_slots
            conv[:num_decodes], windows[slots] = causal_conv_step(bx[:num_decodes], windows[slots], weight, bias, None)
        for start, length, slot in batch.prefills:
            rows = slice(start, start + length)
            conv[rows], windows[slot] = causal_conv_chunk(bx[rows], windows[slot], weight, bias, None)
        return self.out_proj(gate_c * conv)


class Lfm2Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.out_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, nh, nkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_layernorm(self.q_proj(x).view(num_tokens * nh, hd)).view(num_tokens, nh, hd)
        k = self.k_layernorm(self.k_proj(x).view(num_tokens * nkv, hd)).view(num_tokens, nkv, hd)
        v = self.v_proj(x).view(num_tokens, nkv, hd)
        qk = rope.rotate(torch.cat([q, k], dim=1), nh + nkv)
        out = paged_attention(qk[:, :nh], qk[:, nh:], v, kv_cache[0], kv_cache[1], meta, self.scale, None)
        return self.out_proj(out.reshape(num_tokens, nh * hd))


class Lfm2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inter = config.intermediate_size
        if config.block_auto_adjust_ff_dim:  # transformers' rule for the real checkpoints' sizes
            inter = int(2 * inter / 3)
            if config.block_ffn_dim_multiplier is not None:
                inter = int(config.block_ffn_dim_multiplier * inter)
                inter = config.block_multiple_of * ((inter + config.block_multiple_of - 1) // config.block_multiple_of)
        self.w1 = Linear(config.hidden_size, inter, bias=False)
        self.w3 = Linear(config.hidden_size, inter, bias=False)
        self.w2 = Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.is_conv = config.layer_types[layer_idx] == CONV
        if self.is_conv:
            self.conv = ShortConv(config, layer_idx)
        else:
            self.self_attn = Lfm2Attention(config)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.conv(h, meta) if self.is_conv else self.self_attn(h, rope, kv_cache, meta)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2Model(nn.Module):
    """The LFM2 decoder stack without the LM head (HF's `Lfm2Model`)."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)

    def fuse_weights(self) -> None:
        """Nothing to fuse: the projections keep the checkpoint's layout."""

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = inputs_embeds  # [T, hidden]
        rope = self.rotary.for_positions(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.embedding_norm(x)


class Lfm2VlForConditionalGeneration(DecoderLMMixin, nn.Module):
    """`SupportsMultiModal` (images), declaring a hybrid decoder's `state_spec`."""

    supports_multimodal = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlMultiModalProjector

        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Lfm2VlMultiModalProjector(config)
        text = config.text_config
        self.language_model = Lfm2Model(text, max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        text = hf_config.get_text_config()
        layer_ids = tuple(i for i, t in enumerate(text.layer_types[:text.num_hidden_layers]) if t == CONV)
        return replace(super().get_capabilities(hf_config),
                       state_spec=StateSpec(layer_ids, text.hidden_size, text.conv_L_cache - 1))

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        text = hf_config.get_text_config()
        kinds = set(text.layer_types[:text.num_hidden_layers]) - {CONV, "full_attention"}
        if kinds:
            raise ValueError(f"model: {cls.__name__} with layer types {sorted(kinds)} is not supported; "
                             "expected 'conv' and 'full_attention'")

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """items[i]: {"pixel_values": [views, patches, 3 * P * P], "spatial_shapes": [views, 2],
        "pixel_attention_mask": [views, patches], "span_ids": [L]} -> [L, hidden] each."""
        from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlModel

        owner = SimpleNamespace(config=self.config, vision_tower=self.vision_tower,
                                multi_modal_projector=self.multi_modal_projector)
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = []
        for item in items:
            if "image_embeds" in item:  # given by the user: the span's image-token rows
                out.append(span_embeddings(self.language_model.embed_tokens, item["span_ids"],
                                           self.config.image_token_id, item["image_embeds"]))
                continue
            features = Lfm2VlModel.get_image_features(
                owner, pixel_values=item["pixel_values"].to(dtype), spatial_shapes=item["spatial_shapes"],
                pixel_attention_mask=item["pixel_attention_mask"], return_dict=True).pooler_output
            out.append(span_embeddings(self.language_model.embed_tokens, item["span_ids"],
                                       self.config.image_token_id, torch.cat(list(features))))
        return out
