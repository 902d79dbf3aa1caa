"""Tiny random LightOnOCR checkpoints (Pixtral tower with 2-D rotary over each image's own
patch grid, RMS norm + 2x2 patch merger + MLP projector, Qwen 3 decoder with q/k norms), built
offline with transformers' own classes, LightOnOcrProcessor and PixtralImageProcessor (an image
keeps its aspect ratio, longest edge at most `longest_edge`; one `<|image_pad|>` per merged
2x2 patches)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|image_pad|>", "<|vision_pad|>", "<|vision_end|>"]
IMAGE_TOKENS = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
                "image_end_token": "<|vision_end|>"}
PLACEHOLDER = "<|image_pad|>"
# "base": longest edge 64 (up to 16 tokens), tied embeddings (the released layout).
# "gqa": longest edge 48, 3 heads on 1 KV head of head_dim 24, 3 layers, untied, a 3-layer tower.
CONFIGS = {
    "base": dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, text_layers=2, longest_edge=64,
                 tie_word_embeddings=True),
    "gqa": dict(hidden=48, num_heads=3, num_kv_heads=1, head_dim=24, text_layers=3, longest_edge=48,
                tie_word_embeddings=False, vision_layers=3),
}


def build_tiny_lighton_ocr(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                           num_kv_heads: int = 2, head_dim: int = 16, text_layers: int = 2, patch_size: int = 8,
                           longest_edge: int = 64, tie_word_embeddings: bool = True, vision_layers: int = 2,
                           init_std: float = 0.2) -> Path:
    """Save a random LightOnOcrForConditionalGeneration with its LightOnOcrProcessor."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens=IMAGE_TOKENS)
    text = tf.Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
                          initializer_range=init_std, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          tie_word_embeddings=tie_word_embeddings)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                                    num_attention_heads=4, head_dim=8, image_size=longest_edge,
                                    patch_size=patch_size, initializer_range=init_std)
    config = tf.LightOnOcrConfig(vision_config=vision, text_config=text, spatial_merge_size=2,
                                 image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                                 tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.LightOnOcrForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    merged = patch_size * 2
    image_processor = tf.PixtralImageProcessor(size={"longest_edge": longest_edge},
                                               patch_size={"height": merged, "width": merged})
    processor = tf.LightOnOcrProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                       spatial_merge_size=2)
    return save_checkpoint(out, model, processor, tokenizer)
