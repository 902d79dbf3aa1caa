"""Tiny random PerceptionLM checkpoints (Perception Encoder tower through timm: a ViT with 2-D
rotary and a CLS token; a two-layer projector with 2x2 adaptive pooling; Llama decoder), built
offline with transformers' own classes (the tower is TimmWrapperModel, timm's architecture
built from its config, nothing downloaded) and PerceptionLMProcessor (thumbnail + tiles per
image, `pixel_values` [images, tiles, 3, H, W])."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|image|>", "<|video|>"]
PLACEHOLDER = "<|image|>"
# "tiles": a thumbnail + one tile of 32 pixels per image (4 tokens each after pooling), tied (more
# tiles give images of other aspect ratios other tile counts, which transformers' own processor
# cannot stack into one prompt's tensor);
# "thumb": one 48-pixel view per image (9 tokens), 3 heads on 1 KV head, untied.
CONFIGS = {
    "tiles": dict(hidden=64, num_heads=4, num_kv_heads=2, text_layers=2, tile_size=32, max_tiles=1,
                  tie_word_embeddings=True),
    "thumb": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=3, tile_size=48, max_tiles=0,
                  tie_word_embeddings=False),
}


def build_tiny_perception_lm(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                             num_kv_heads: int = 2, text_layers: int = 2, tile_size: int = 32, patch_size: int = 8,
                             max_tiles: int = 4, tie_word_embeddings: bool = True, init_std: float = 0.2) -> Path:
    """Save a random PerceptionLMForConditionalGeneration with its processor (`max_tiles=0`:
    one thumbnail view per image)."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS,
                                extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, max_position_embeddings=1024, initializer_range=init_std,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    vision = tf.TimmWrapperConfig(architecture="vit_pe_core_tiny_patch16_384", do_pooling=False,
                                  initializer_range=init_std,
                                  model_args={"img_size": tile_size, "patch_size": patch_size, "embed_dim": 32,
                                              "depth": 2, "num_heads": 4, "global_pool": "",
                                              "use_post_transformer_norm": False})
    config = tf.PerceptionLMConfig(vision_config=vision, text_config=text, projector_pooling_ratio=2,
                                   image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"),
                                   video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"),
                                   tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.PerceptionLMForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    kinds = dict(tile_size=tile_size, max_num_tiles=max(max_tiles, 1),
                 vision_input_type="thumb+tile" if max_tiles else "vanilla")
    image_processor = tf.PerceptionLMImageProcessor(**kinds)
    video_processor = tf.PerceptionLMVideoProcessor(tile_size=tile_size)
    processor = tf.PerceptionLMProcessor(video_processor=video_processor, image_processor=image_processor,
                                         tokenizer=tokenizer, patch_size=patch_size, pooling_ratio=2)
    return save_checkpoint(out, model, processor, tokenizer)
