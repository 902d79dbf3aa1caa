"""Tiny random VipLLaVA checkpoints (CLIP tower read at several layers at once: the selected
layers' features concatenated, layer-normed and projected; Llama decoder), built offline with
transformers' own classes and LLaVA's processor, as the released -hf checkpoints ship it."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
PLACEHOLDER = "<image>"
# "layers3": features of tower layers -2, -1 and 1 of 3, untied; "layers2": layers 0 and -1 of
# 2, 3 heads on 1 KV head, tied embeddings, 48-pixel images.
CONFIGS = {
    "layers3": dict(vision_layers=3, feature_layers=[-2, -1, 1], image_size=32, hidden=64, num_heads=4,
                    num_kv_heads=2, tie_word_embeddings=False),
    "layers2": dict(vision_layers=2, feature_layers=[0, -1], image_size=48, hidden=48, num_heads=3,
                    num_kv_heads=1, tie_word_embeddings=True),
}


def build_tiny_vipllava(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                        num_kv_heads: int = 2, text_layers: int = 2, vision_layers: int = 3,
                        feature_layers: list[int] | None = None, image_size: int = 32, patch_size: int = 8,
                        tie_word_embeddings: bool = False, init_std: float = 0.2) -> Path:
    """Save a random VipLlavaForConditionalGeneration with its LlavaProcessor; an image gives
    (image_size / patch_size)^2 `<image>` tokens (CLIP's CLS row dropped)."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<image>"})
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, max_position_embeddings=1024, initializer_range=init_std,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                                 num_attention_heads=4, image_size=image_size, patch_size=patch_size, projection_dim=32)
    config = tf.VipLlavaConfig(vision_config=vision, text_config=text,
                               vision_feature_layer=list(feature_layers or [-2, -1]),
                               image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                               image_seq_length=(image_size // patch_size) ** 2,
                               tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.VipLlavaForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.CLIPImageProcessor(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                  num_additional_image_tokens=1, vision_feature_select_strategy="default")
    return save_checkpoint(out, model, processor, tokenizer)
