"""Tiny random Mllama (Llama 3.2 Vision) checkpoints (tiled vision encoder with global layers,
a Llama decoder that reads the image through cross-attention layers), built offline with
transformers' own classes and MllamaProcessor. Out of the transformers backend's scope (the
image is read by cross-attention, not merged into the prompt): the refusal tests use it."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|image|>", "<|python_tag|>"]
PLACEHOLDER = "<|image|>"
# "cross": 3 layers, layer 1 cross-attention, untied; "cross_two": 4 layers, layers 1 and 3.
CONFIGS = {
    "cross": dict(text_layers=3, cross_attention_layers=[1], tie_word_embeddings=False),
    "cross_two": dict(text_layers=4, cross_attention_layers=[1, 3], tie_word_embeddings=True),
}


def build_tiny_mllama(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, text_layers: int = 3,
                      cross_attention_layers: list[int] | None = None, tie_word_embeddings: bool = False,
                      init_std: float = 0.2) -> Path:
    """Save a random MllamaForConditionalGeneration (32-pixel tiles, up to 2 per image) with its processor."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<|image|>"})
    text = tf.MllamaTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                               num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2,
                               cross_attention_layers=cross_attention_layers or [1], max_position_embeddings=1024,
                               initializer_range=init_std, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               tie_word_embeddings=tie_word_embeddings)
    vision = tf.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                   attention_heads=4, image_size=32, patch_size=8, max_num_tiles=2,
                                   intermediate_layers_indices=[0], vision_output_dim=64,
                                   supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    config = tf.MllamaConfig(vision_config=vision, text_config=text,
                             image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"),
                             tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.MllamaForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.MllamaImageProcessor(size={"height": 32, "width": 32}, max_image_tiles=2)
    processor = tf.MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return save_checkpoint(out, model, processor, tokenizer)
