"""Tiny random DeepSeek-VL checkpoints (SigLIP tower, a two-layer GELU aligner, Llama decoder),
built offline with transformers' own classes, DeepseekVLProcessor and DeepseekVLImageProcessor
(an image is padded to a square on the mean colour, resized, and gives a fixed run of
`<image_placeholder>` tokens). Its image features are computed by the base model
(`model.model.get_image_features`)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import (build_tokenizer, randomize_constant_weights, save_checkpoint,
                                          tiny_siglip_vision)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image_placeholder>"]
PLACEHOLDER = "<image_placeholder>"
# "base": 32-pixel images, 16 tokens, tied embeddings (the released layout).
# "gqa": 24-pixel images (9 tokens), 3 heads on 1 KV head, 3 layers, untied, a 48-wide tower.
CONFIGS = {
    "base": dict(hidden=64, num_heads=4, num_kv_heads=4, text_layers=2, image_size=32, tie_word_embeddings=True),
    "gqa": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=3, image_size=24, tie_word_embeddings=False,
                vision_hidden=48),
}


def build_tiny_deepseek_vl(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                           num_kv_heads: int = 4, text_layers: int = 2, image_size: int = 32, patch_size: int = 8,
                           tie_word_embeddings: bool = True, vision_hidden: int = 32,
                           init_std: float = 0.2) -> Path:
    """Save a random DeepseekVLForConditionalGeneration with its DeepseekVLProcessor; an image
    gives (image_size / patch_size)^2 `<image_placeholder>` tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS,
                                extra_special_tokens={"image_token": "<image_placeholder>"})
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, max_position_embeddings=1024, initializer_range=init_std,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    config = tf.DeepseekVLConfig(vision_config=tiny_siglip_vision(image_size, patch_size, hidden=vision_hidden),
                                 text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(PLACEHOLDER),
                                 tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.DeepseekVLForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.DeepseekVLImageProcessor(size={"height": image_size, "width": image_size}, min_size=8)
    processor = tf.DeepseekVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                       num_image_tokens=(image_size // patch_size) ** 2)
    return save_checkpoint(out, model, processor, tokenizer)
