"""Tiny random Cohere2-Vision checkpoints (SigLIP tower, pixel shuffle 2x2, SwiGLU projector
without the layer norm, Cohere 2 decoder), built offline with transformers' own classes,
Cohere2VisionProcessor and Cohere2VisionImageProcessor (tiles + thumbnail; each tile is a run
of `<|IMG_PATCH|>` closed by `<|IMG_LINE_BREAK|>`, the image between `<|START_OF_IMG|>` and
`<|END_OF_IMG|>`). The prompt's placeholder is `<|IMG_PATCH|>` once per image."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import (build_tokenizer, randomize_constant_weights, save_checkpoint,
                                          tiny_cohere2_text, tiny_siglip_vision)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
                  "<|IMG_LINE_BREAK|>"]
IMAGE_TOKENS = {"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>",
                "img_line_break_token": "<|IMG_LINE_BREAK|>"}
PLACEHOLDER = "<|IMG_PATCH|>"
# "tiles": up to 3 tiles of 32 pixels + thumbnail, 4 tokens each, 4 layers (one global), tied.
# "wide": up to 2 tiles of 48 pixels (9 tokens each), a 48-wide tower of 3 layers, 3 heads on
# 1 KV head, untied, a stronger logit scale.
CONFIGS = {
    "tiles": dict(hidden=64, num_heads=4, num_kv_heads=2, text_layers=4, image_size=32, max_patches=3,
                  sliding_window=16, tie_word_embeddings=True, logit_scale=0.5),
    "wide": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=4, image_size=48, max_patches=2,
                 sliding_window=20, tie_word_embeddings=False, logit_scale=2.0, vision_hidden=48, vision_layers=3),
}


def build_tiny_cohere2_vision(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                              num_kv_heads: int = 2, text_layers: int = 4, image_size: int = 32,
                              patch_size: int = 8, max_patches: int = 3, sliding_window: int = 16,
                              tie_word_embeddings: bool = True, logit_scale: float = 0.5, vision_hidden: int = 32,
                              vision_layers: int = 2, init_std: float = 0.2) -> Path:
    """Save a random Cohere2VisionForConditionalGeneration with its processor; a tile is
    `image_size` square and gives (image_size / patch_size / 2)^2 `<|IMG_PATCH|>` tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens=IMAGE_TOKENS)
    text = tiny_cohere2_text(tokenizer, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             layers=text_layers, sliding_window=sliding_window,
                             tie_word_embeddings=tie_word_embeddings, init_std=init_std, logit_scale=logit_scale)
    vision = tiny_siglip_vision(image_size, patch_size, hidden=vision_hidden, layers=vision_layers)
    config = tf.Cohere2VisionConfig(vision_config=vision, text_config=text, downsample_factor=2,
                                    alignment_intermediate_size=hidden * 2,
                                    image_token_id=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
                                    tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Cohere2VisionForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    tokens_per_side = image_size // patch_size // 2
    image_processor = tf.Cohere2VisionImageProcessor(size={"height": image_size, "width": image_size},
                                                     crop_to_patches=max_patches > 1, min_patches=1,
                                                     max_patches=max_patches, patch_size=tokens_per_side)
    processor = tf.Cohere2VisionProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return save_checkpoint(out, model, processor, tokenizer)
