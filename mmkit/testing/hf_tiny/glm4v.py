"""Tiny random GLM-4.1V and GLM-4.5V (MoE decoder) checkpoints (Glm4v vision tower: 3-D patch embedding, learned position
embeddings interpolated per image, 2-D axial rotary, 2x2 patch merger; GLM-4 decoder with its
own 3-D rotary over half of each head, post-attention and post-MLP norms), built offline with
transformers' own classes and Glm4vProcessor (an image is `<|begin_of_image|>` `<|image|>`*
`<|end_of_image|>`, one `<|image|>` per 2x2 merged patches)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|image|>", "<|video|>", "<|begin_of_image|>",
                  "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"]
IMAGE_TOKENS = {"image_token": "<|image|>", "video_token": "<|video|>"}
PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
# "base": 2 heads of 32 (rotary over 16 of them: sections [2, 3, 3]), untied. "gqa": 4 heads on
# 1 KV head of 24 (sections [1, 2, 3]), tied embeddings, a deeper tower of 48 wide.
# GLM-4.5V (Glm4vMoe, `moe=True`): "moe": layer 0 dense, then 4 routed experts (top 2) + a shared
# one, untied; "moe_gqa": 3 layers, 6 experts (top 1), 4 heads on 2 KV heads, tied.
CONFIGS = {
    "moe": dict(moe=True, hidden=64, num_heads=2, num_kv_heads=2, text_layers=3, mrope_section=[2, 3, 3],
                num_experts=4, experts_per_token=2, tie_word_embeddings=False),
    "moe_gqa": dict(moe=True, hidden=96, num_heads=4, num_kv_heads=2, text_layers=3, mrope_section=[1, 2, 3],
                    num_experts=6, experts_per_token=1, tie_word_embeddings=True),
    "base": dict(hidden=64, num_heads=2, num_kv_heads=2, text_layers=2, mrope_section=[2, 3, 3],
                 vision_hidden=32, vision_depth=2, tie_word_embeddings=False),
    "gqa": dict(hidden=96, num_heads=4, num_kv_heads=1, text_layers=3, mrope_section=[1, 2, 3],
                vision_hidden=48, vision_depth=3, tie_word_embeddings=True),
}


def build_tiny_glm4v(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 2,
                     num_kv_heads: int = 2, text_layers: int = 2, mrope_section: list[int] | None = None,
                     vision_hidden: int = 32, vision_depth: int = 2, patch_size: int = 8,
                     tie_word_embeddings: bool = False, init_std: float = 0.2, moe: bool = False,
                     num_experts: int = 4, experts_per_token: int = 2) -> Path:
    """Save a random Glm4vForConditionalGeneration (`moe=True`: GLM-4.5V's
    Glm4vMoeForConditionalGeneration, its first layer dense) with its Glm4vProcessor. One
    `<|image|>` token covers (2 * patch_size)^2 pixels; images are resized to between 4 and 16 tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens=IMAGE_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                num_hidden_layers=text_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=1024, initializer_range=init_std,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": mrope_section or [2, 3, 3]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, num_heads=4, intermediate_size=vision_hidden * 2,
                  out_hidden_size=hidden, image_size=32, patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=init_std)
    if moe:
        text.update(moe_intermediate_size=hidden, n_routed_experts=num_experts, num_experts_per_tok=experts_per_token,
                    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True)
    config_cls, model_cls = ((tf.Glm4vMoeConfig, tf.Glm4vMoeForConditionalGeneration) if moe
                             else (tf.Glm4vConfig, tf.Glm4vForConditionalGeneration))
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                            video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                            image_end_token_id=ids["<|end_of_image|>"],
                            video_start_token_id=ids["<|begin_of_video|>"],
                            video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_constant_weights(model)
    factor = 2 * patch_size
    size = {"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * 16}
    image_processor = tf.Glm4vImageProcessor(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2)
    video_processor = tf.Glm4vVideoProcessor(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2)
    processor = tf.Glm4vProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                  video_processor=video_processor)
    return save_checkpoint(out, model, processor, tokenizer)
