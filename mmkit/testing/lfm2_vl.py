"""Build tiny random LFM2-VL checkpoints offline with transformers' own classes (Lfm2VlConfig,
the LFM2 hybrid decoder of short-convolution and attention layers, the SigLIP2 NaFlex tower,
Lfm2VlProcessor / Lfm2VlImageProcessor), saved by transformers.

An image larger than a tile is cut into `tile_size` tiles (each `<|img_row_i_col_j|>` + its
tokens) plus a thumbnail (`<|img_thumbnail|>` + its tokens), all inside `<|image_start|>` ...
`<|image_end|>`; a small image is one view at its own (patch-rounded) size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import build_tokenizer

LAYOUT_TOKENS = (["<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"]
                 + [f"<|img_row_{i}_col_{j}|>" for i in range(1, 5) for j in range(1, 5)])
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_lfm2_vl(out_dir: str | Path, *, seed: int = 0, layer_types: tuple[str, ...] = (
                           "conv", "conv", "full_attention", "conv"), hidden: int = 64, num_heads: int = 4,
                       num_kv_heads: int = 2, conv_kernel: int = 3, patch_size: int = 8, tile_size: int = 32,
                       min_image_tokens: int = 4, max_image_tokens: int = 16, max_tiles: int = 4,
                       init_std: float = 0.08, max_position_embeddings: int = 2048) -> Path:
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<image>", "<|im_start|>",
                                                     "<|im_end|>", *LAYOUT_TOKENS],
                                extra_special_tokens={"image_token": "<image>"})
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                num_hidden_layers=len(layer_types), num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                layer_types=list(layer_types), conv_L_cache=conv_kernel, conv_bias=False,
                max_position_embeddings=max_position_embeddings, norm_eps=1e-5, initializer_range=init_std,
                block_auto_adjust_ff_dim=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  patch_size=patch_size, num_patches=(tile_size // patch_size) ** 2, initializer_range=init_std,
                  vision_use_head=False)
    config = tf.Lfm2VlConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                             image_token_id=tokenizer.convert_tokens_to_ids("<image>"), downsample_factor=2,
                             tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.Lfm2VlForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                        pad_token_id=text["pad_token_id"]).save_pretrained(out)
    image_processor = tf.Lfm2VlImageProcessor(tile_size=tile_size, encoder_patch_size=patch_size, downsample_factor=2,
                                              min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
                                              min_tiles=2, max_tiles=max_tiles, do_image_splitting=True,
                                              use_thumbnail=True, max_pixels_tolerance=2.0)
    processor = tf.Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out
