"""Build tiny random Qwen3.5 / Qwen3.5-MoE checkpoints offline with transformers' own classes.

The tokenizer and chat template are the Qwen2-VL builder's (same special tokens); the processor
is transformers' `Qwen3VLProcessor`, which Qwen3.5 checkpoints name. The decoder is hybrid:
`layer_types` puts Gated DeltaNet layers ("linear_attention") before every `full_attention_every`-th
full-attention layer; value heads are a multiple of key heads (grouped), the full-attention layers
rotate a quarter of head_dim (`partial_rotary_factor`) with interleaved M-RoPE. The MoE variant
puts experts (with transformers' shared expert) in every layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.qwen2_vl import SPECIAL_TOKENS, build_qwen_tokenizer
from mmkit.testing.qwen3_vl import save_generation_and_processor


# The parity tests' second configuration (tests/models/test_second_configs.py): 3 layers (two Gated
# DeltaNet, then attention), 3 heads on 1 KV head of 40 (rotating 10 dims: M-RoPE sections 3/1/1),
# one key head serving 3 value heads (key dim 24, value dim 20), conv kernel 3, tied embeddings (init_std
# 0.1: at 0.2 the tied head gives two prompts one answer);
# MoE with 5 experts, 3 per token.
_SECOND = dict(text_layers=3, full_attention_every=3, hidden=48, num_heads=3, num_kv_heads=1, head_dim=40,
               linear_key_heads=1, linear_value_heads=3, linear_key_dim=24, linear_value_dim=20, conv_kernel=3,
               tie_word_embeddings=True, init_std=0.1)
SECOND_CONFIGS = {
    "Qwen3_5ForConditionalGeneration": dict(moe=False, **_SECOND),
    "Qwen3_5MoeForConditionalGeneration": dict(moe=True, num_experts=5, num_experts_per_tok=3, **_SECOND),
}


def build_tiny_qwen3_5(out_dir: str | Path, *, seed: int = 0, moe: bool = False, text_layers: int = 4,
                       full_attention_every: int = 2, hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                       head_dim: int = 32, partial_rotary_factor: float = 0.25, linear_key_heads: int = 2,
                       linear_value_heads: int = 4, linear_key_dim: int = 16, linear_value_dim: int = 16,
                       conv_kernel: int = 4, vision_depth: int = 2, vision_dim: int = 32, vision_heads: int = 4,
                       patch_size: int = 8, min_pixels: int = 16 * 16 * 4, max_pixels: int = 16 * 16 * 16,
                       video_fps: float = 12.0, num_experts: int = 6, num_experts_per_tok: int = 2,
                       max_position_embeddings: int = 2048, init_std: float = 0.08,
                       tie_word_embeddings: bool = False, num_position_embeddings: int = 64,
                       intermediate: int | None = None, vision_intermediate: int | None = None,
                       tokenizer=None) -> Path:
    """Save a random Qwen3.5 (`moe=False`) or Qwen3.5-MoE (`moe=True`) with its processor.
    Layer i is full attention when (i + 1) is a multiple of `full_attention_every`."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_qwen_tokenizer(out)
    else:
        tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    half = int(head_dim * partial_rotary_factor) // 2  # interleaved M-RoPE over the rotary dims
    section = [half - 2 * (half // 3), half // 3, half // 3]
    layer_types = ["full_attention" if (i + 1) % full_attention_every == 0 else "linear_attention"
                   for i in range(text_layers)]
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                num_hidden_layers=text_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                layer_types=layer_types, linear_conv_kernel_dim=conv_kernel, linear_key_head_dim=linear_key_dim,
                linear_value_head_dim=linear_value_dim, linear_num_key_heads=linear_key_heads,
                linear_num_value_heads=linear_value_heads,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": section,
                                 "mrope_interleaved": True, "partial_rotary_factor": partial_rotary_factor},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], initializer_range=init_std,
                tie_word_embeddings=tie_word_embeddings)
    if moe:
        text.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                    moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2)
        del text["intermediate_size"]
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=vision_intermediate or vision_dim * 2,
                  num_heads=vision_heads, out_hidden_size=hidden, patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=num_position_embeddings,
                  initializer_range=init_std)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=tie_word_embeddings)
    config_cls, model_cls = ((tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration) if moe
                             else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration))
    config = config_cls(text_config=text, vision_config=vision, **common)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers zero-initialises the (1 + w) norms: give them some spread
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name and "linear_attn" not in name:
                p.normal_(0.0, 0.1)
            elif ".experts." in name:  # initialised with std 0.02 whatever initializer_range says
                p.normal_(0.0, init_std)
    model.save_pretrained(out)
    save_generation_and_processor(out, text, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels,
                                  patch_size=patch_size, video_fps=video_fps)
    return out
