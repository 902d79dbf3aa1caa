"""Tiny random Aya Vision checkpoints (SigLIP tower, pixel shuffle 2x2, layer norm + SwiGLU
projector, Cohere 2 decoder with sliding and global layers), built offline with transformers'
own classes, AyaVisionProcessor and GotOcr2ImageProcessor (an image is split into up to
`max_patches` tiles plus a global thumbnail; each becomes a `TILE_i` / `TILE_GLOBAL` text
marker and a run of `<|IMG_PATCH|>` tokens between `<|START_OF_IMG|>` and `<|END_OF_IMG|>`)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import (build_tokenizer, randomize_constant_weights, save_checkpoint,
                                          tiny_cohere2_text, tiny_siglip_vision)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
                  "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
PLACEHOLDER = "<image>"
# "tiles": up to 4 tiles of 32 pixels (+ thumbnail), 4 tokens each, a 16-token window, tied.
# "single": one tile per image (no split), 9 tokens each (48-pixel tile, 8-pixel patches: 6x6
# features shuffled 2x2), 3 heads on 1 KV head, 5 layers (layer 4 global), untied.
CONFIGS = {
    "tiles": dict(hidden=64, num_heads=4, num_kv_heads=2, text_layers=4, image_size=32, max_patches=4,
                  sliding_window=16, tie_word_embeddings=True),
    "single": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=5, image_size=48, max_patches=1,
                   sliding_window=24, tie_word_embeddings=False),
}


def build_tiny_aya_vision(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                          num_kv_heads: int = 2, text_layers: int = 4, image_size: int = 32, patch_size: int = 8,
                          max_patches: int = 4, sliding_window: int = 16, tie_word_embeddings: bool = True,
                          init_std: float = 0.2) -> Path:
    """Save a random AyaVisionForConditionalGeneration with its AyaVisionProcessor; a tile is
    `image_size` square and gives (image_size / patch_size / 2)^2 `<|IMG_PATCH|>` tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<image>"})
    text = tiny_cohere2_text(tokenizer, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             layers=text_layers, sliding_window=sliding_window,
                             tie_word_embeddings=tie_word_embeddings, init_std=init_std)
    config = tf.AyaVisionConfig(vision_config=tiny_siglip_vision(image_size, patch_size), text_config=text,
                                downsample_factor=2, alignment_intermediate_size=hidden * 2,
                                image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
                                tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.AyaVisionForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.GotOcr2ImageProcessor(size={"height": image_size, "width": image_size},
                                               crop_to_patches=max_patches > 1, min_patches=1,
                                               max_patches=max_patches)
    processor = tf.AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                      img_size=image_size, downsample_factor=2)
    return save_checkpoint(out, model, processor, tokenizer)
