"""Tiny random LFM2-VL checkpoints (SigLIP 2 tower, pixel-unshuffle projector, LFM2 hybrid
decoder: short convolution layers between the attention layers), built offline with
transformers' own classes and Lfm2VlProcessor. Out of the transformers backend's scope (a
hybrid: the convolution layers keep per-request state, not a KV cache): the refusal tests use it."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<|image_start|>", "<|image_end|>",
                  "<|img_thumbnail|>"]
PLACEHOLDER = "<image>"
# "hybrid": conv, attention, conv; "hybrid_tied": attention first, two conv layers, tied embeddings.
CONFIGS = {
    "hybrid": dict(layer_types=["conv", "full_attention", "conv"], tie_word_embeddings=False),
    "hybrid_tied": dict(layer_types=["full_attention", "conv", "conv"], tie_word_embeddings=True),
}


def build_tiny_lfm2_vl(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                       layer_types: list[str] | None = None, tie_word_embeddings: bool = False,
                       init_std: float = 0.2) -> Path:
    """Save a random Lfm2VlForConditionalGeneration (32-pixel tiles, 8-pixel patches) with its processor."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<image>"})
    layer_types = layer_types or ["conv", "full_attention", "conv"]
    text = tf.Lfm2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=len(layer_types), num_attention_heads=num_heads, num_key_value_heads=2,
                         layer_types=layer_types, block_multiple_of=16, max_position_embeddings=1024,
                         initializer_range=init_std, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=tie_word_embeddings)
    vision = tf.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_patches=16, patch_size=8)
    config = tf.Lfm2VlConfig(vision_config=vision, text_config=text, projector_hidden_size=hidden,
                             downsample_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                             tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Lfm2VlForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.Lfm2VlImageProcessor(tile_size=32, encoder_patch_size=8, min_image_tokens=4,
                                              max_image_tokens=16, do_image_splitting=False,
                                              size={"height": 32, "width": 32})
    processor = tf.Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return save_checkpoint(out, model, processor, tokenizer)
