"""Tiny random Llama 4 checkpoints (Llama4VisionModel with pixel shuffle + MLP, a linear
projector, the Llama 4 MoE decoder: routed experts + shared expert, chunked attention on the
rotary layers, every `no_rope_layer_interval`-th layer without rotary, q/k L2 norms, attention
temperature tuning), built offline with transformers' own classes and Llama4Processor (an image
is `<|image_start|>` [tiles `<|patch|>`* with separators] `<|image|>` `<|patch|>`* `<|image_end|>`)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>",
                  "<|tile_x_separator|>", "<|tile_y_separator|>"]
IMAGE_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>"}
# "moe": every layer MoE (4 experts, top-1), chunk 8 on the rotary layers (prompts span several
# chunks), layer 4 without rotary, untied; images of one 32-pixel tile (4 patch tokens) or up to
# 4 tiles + the global one. "interleaved": dense and MoE layers alternate (interleave step 2,
# 3 experts), chunk 16, every 2nd layer without rotary, 3 heads on 1 KV head, tied embeddings.
CONFIGS = {
    "moe": dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, text_layers=4, num_experts=4,
                interleave_moe_layer_step=1, attention_chunk_size=8, no_rope_layer_interval=4,
                tie_word_embeddings=False, max_patches=4),
    "interleaved": dict(hidden=48, num_heads=3, num_kv_heads=1, head_dim=16, text_layers=4, num_experts=3,
                        interleave_moe_layer_step=2, attention_chunk_size=16, no_rope_layer_interval=2,
                        tie_word_embeddings=True, max_patches=2),
}


def build_tiny_llama4(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                      num_kv_heads: int = 2, head_dim: int = 16, text_layers: int = 4, num_experts: int = 4,
                      interleave_moe_layer_step: int = 1, attention_chunk_size: int = 8,
                      no_rope_layer_interval: int = 4, tie_word_embeddings: bool = False, image_size: int = 32,
                      patch_size: int = 8, max_patches: int = 4, init_std: float = 0.2) -> Path:
    """Save a random Llama4ForConditionalGeneration with its Llama4Processor. A tile is
    `image_size` square; its (image_size / patch_size)^2 patches are pixel-shuffled 4:1."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens=IMAGE_TOKENS)
    text = tf.Llama4TextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                               intermediate_size_mlp=hidden * 3, num_hidden_layers=text_layers,
                               num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                               num_local_experts=num_experts, num_experts_per_tok=1,
                               interleave_moe_layer_step=interleave_moe_layer_step,
                               attention_chunk_size=attention_chunk_size, no_rope_layer_interval=no_rope_layer_interval,
                               floor_scale=4, attn_scale=0.5, max_position_embeddings=512, initializer_range=init_std,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    vision_hidden = 32
    vision = tf.Llama4VisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 4,
                                   num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                                   patch_size=patch_size, pixel_shuffle_ratio=0.5, projector_input_dim=64,
                                   projector_output_dim=64, vision_output_dim=64, initializer_range=init_std)
    ids = {name: tokenizer.convert_tokens_to_ids(token)
           for name, token in [("boi", "<|image_start|>"), ("eoi", "<|image_end|>"), ("patch", "<|patch|>")]}
    config = tf.Llama4Config(vision_config=vision, text_config=text, boi_token_index=ids["boi"],
                             eoi_token_index=ids["eoi"], image_token_index=ids["patch"],
                             tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Llama4ForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.Llama4ImageProcessor(size={"height": image_size, "width": image_size},
                                              max_patches=max_patches)
    processor = tf.Llama4Processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                   pixel_shuffle_ratio=0.5, chat_template=None)
    return save_checkpoint(out, model, processor, tokenizer)
