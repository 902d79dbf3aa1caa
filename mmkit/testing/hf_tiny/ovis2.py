"""Tiny random Ovis2 checkpoints (AIMv2-style tower, a visual tokenizer: softmax over a visual
vocabulary, its rows looked up in a visual embedding table; Qwen 2 decoder), built offline with
transformers' own classes, Ovis2Processor and Ovis2ImageProcessor. An image is `<IMG_START>`
`<IMG_ATOM>`* `<IMG_GRID>` [tiles of `<IMG_ATOM>`* separated by `<IMG_COL>` / `<IMG_ROW>`]
`<IMG_END>`; the five markers are visual indicator tokens whose embeddings come from the visual
table too, not from the text embeddings."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

INDICATORS = ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<IMG_ATOM>"] + INDICATORS
PLACEHOLDER = "<image>"
# "tiles": up to 4 tiles of 32 pixels (4 atoms each after the 2x2 stride), tied embeddings.
# "single": no tiling, 48-pixel images (9 atoms), 3 heads on 1 KV head, untied, 3 layers.
CONFIGS = {
    "tiles": dict(hidden=64, num_heads=4, num_kv_heads=2, text_layers=2, image_size=32, max_patches=4,
                  tie_word_embeddings=True),
    "single": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=3, image_size=48, max_patches=1,
                   tie_word_embeddings=False),
}


def build_tiny_ovis2(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, text_layers: int = 2, image_size: int = 32, patch_size: int = 8,
                     max_patches: int = 4, visual_vocab_size: int = 64, tie_word_embeddings: bool = True,
                     init_std: float = 0.2) -> Path:
    """Save a random Ovis2ForConditionalGeneration with its Ovis2Processor; a tile is
    `image_size` square and gives (image_size / patch_size / 2)^2 `<IMG_ATOM>` tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<image>"})
    text = tf.Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                          initializer_range=init_std, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          tie_word_embeddings=tie_word_embeddings)
    vision = tf.Ovis2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=image_size, patch_size=patch_size, vocab_size=visual_vocab_size,
                                  hidden_stride=2, num_visual_indicator_tokens=len(INDICATORS),
                                  initializer_range=init_std)
    config = tf.Ovis2Config(vision_config=vision, text_config=text, vocab_size=len(tokenizer), hidden_size=hidden,
                            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_ATOM>"),
                            visual_indicator_token_ids=tokenizer.convert_tokens_to_ids(INDICATORS),
                            tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Ovis2ForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.Ovis2ImageProcessor(size={"height": image_size, "width": image_size},
                                             crop_to_patches=max_patches > 1, min_patches=1, max_patches=max_patches)
    processor = tf.Ovis2Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_length=(image_size // patch_size // 2) ** 2)
    return save_checkpoint(out, model, processor, tokenizer)
