"""Tiny random PaliGemma / PaliGemma 2 checkpoints (SigLIP tower, one linear projector, Gemma or
Gemma 2 decoder attending bidirectionally over the image + prompt prefix), built offline with
transformers' own classes and PaliGemmaProcessor. The processor puts `<image>` runs first, then
BOS, the prompt and a newline; it refuses a prompt without an image."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
# "paligemma": Gemma decoder, tied embeddings (the released layout), 16 image tokens.
# "paligemma2": Gemma 2 decoder (attention and final logit soft-capping, a 24-token sliding
# window on every other layer that the prompts outgrow), untied, 3 heads on 1 KV head, 9 image tokens.
CONFIGS = {
    "paligemma": dict(version=1, hidden=64, num_heads=4, num_kv_heads=1, head_dim=16, text_layers=2,
                      image_size=32, patch_size=8, tie_word_embeddings=True),
    "paligemma2": dict(version=2, hidden=48, num_heads=3, num_kv_heads=1, head_dim=24, text_layers=3,
                       image_size=36, patch_size=12, tie_word_embeddings=False, sliding_window=24),
}


def build_tiny_paligemma(out_dir: str | Path, *, version: int = 1, seed: int = 0, hidden: int = 64,
                         num_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 16, text_layers: int = 2,
                         image_size: int = 32, patch_size: int = 8, tie_word_embeddings: bool = True,
                         sliding_window: int = 4096, init_std: float = 0.2) -> Path:
    """Save a random PaliGemmaForConditionalGeneration (`version` 1: Gemma decoder, 2: Gemma 2)
    with its PaliGemmaProcessor; an image gives (image_size / patch_size)^2 `<image>` tokens."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens={"image_token": "<image>"})
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=text_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, max_position_embeddings=512, initializer_range=init_std,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    if version == 1:
        text = tf.GemmaConfig(**common)
    else:
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(text_layers)]
        text = tf.Gemma2Config(**common, sliding_window=sliding_window, layer_types=layer_types,
                               attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                               query_pre_attn_scalar=head_dim)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=image_size, patch_size=patch_size, vision_use_head=False)
    config = tf.PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=hidden, hidden_size=hidden,
                                vocab_size=len(tokenizer), image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.PaliGemmaForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    image_processor.image_seq_length = (image_size // patch_size) ** 2
    processor = tf.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return save_checkpoint(out, model, processor, tokenizer)
