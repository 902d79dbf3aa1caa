"""mmkit's Qwen3 decoder on the paged KV cache (Qwen3, Qwen3-VL's and InternVL3.5's language model).

Qwen3 is the Llama block with one change in attention: each head's q and k are RMS-normalised
over head_dim (`q_norm` / `k_norm`, one weight [head_dim] shared by all heads) before the
rotary embedding. There is no q/k/v bias (`attention_bias`, False in every released checkpoint,
is honoured as Llama honours it), and `head_dim` comes from the checkpoint (128 in Qwen3 while
hidden / heads is e.g. 2048 / 16 = 128 or 4096 / 32; not derived). Everything else (fused
qkv / gate-up matmuls, paged attention, bf16 C kernels) is `models/llama.py`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from mmkit.layers.norms import RMSNorm
from mmkit.layers.rotary import StepRope
from mmkit.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from mmkit.models.moe import SparseMoeBlock, is_moe_layer


class Qwen3Attention(LlamaAttention):
    qk_norm_cls: type[nn.Module] = RMSNorm  # a decoder with another norm arithmetic swaps it (Gemma 3)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)

    def rotate_qk(self, qkv: torch.Tensor, rope: StepRope) -> torch.Tensor:
        # qkv: [T, nh + 2 * nkv, hd]. Each head row normalised as HF's `q_norm(q.view(..., hd))`;
        # the rows are made contiguous [T * heads, hd] first so the bf16 C kernel takes them.
        num_tokens, nh, nkv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :nh].reshape(num_tokens * nh, hd)).view(num_tokens, nh, hd)
        k = self.k_norm(qkv[:, nh:nh + nkv].reshape(num_tokens * nkv, hd)).view(num_tokens, nkv, hd)
        return rope.rotate(torch.cat([q, k], dim=1), nh + nkv)  # [T, nh + nkv, hd], rotated


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    """The Qwen3 decoder stack without the LM head (HF's `Qwen3Model` / `Qwen3VLTextModel`)."""

    decoder_layer_cls = Qwen3DecoderLayer

    def __init__(self, config, max_positions: int, rotary=None) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("model: Qwen3 decoders with use_sliding_window=True are not supported")
        super().__init__(config, max_positions, rotary)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, layer_idx: int):
        # transformers' rule (decoder_sparse_step, mlp_only_layers); dense layers use intermediate_size.
        return SparseMoeBlock(config) if is_moe_layer(config, layer_idx) else LlamaMLP(config)


class Qwen3MoeModel(Qwen3Model):
    """Qwen3 with mixture-of-experts MLPs (HF's `Qwen3MoeModel` / `Qwen3VLMoeTextModel`)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer
