"""Build tiny random InternVL `-HF` checkpoints offline (InternViT + pixel-unshuffle projector +
Qwen2 / Qwen3 decoder), saved by transformers with its own `InternVLProcessor` and GotOcr2
tiling image processor, and the same weights in the transformers 4.x hub layout."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import build_tokenizer, rewrite_hub_layout, tiny_text_config

# The special tokens of the OpenGVLab/InternVL3_5-*-HF tokenizers that the processor reads.
INTERNVL_SPECIAL = {"start_image_token": "<img>", "end_image_token": "</img>",
                    "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<IMG_CONTEXT>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The parity tests' second configuration (tests/models/internvl/test_internvl_second_config.py):
# 3 heads on 1 KV head (GQA ratio 3) of head_dim 40, 3 layers, 48 px tiles (9 tokens each), tied
# embeddings (both config levels), no BOS token (as the real InternVL3.5 tokenizers).
SECOND_CONFIGS = {"InternVLForConditionalGeneration": dict(
    text_type="qwen3", num_heads=3, num_kv_heads=1, head_dim=40, text_layers=3, tile_size=48,
    tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False)}


def build_tiny_internvl(out_dir: str | Path, *, seed: int = 0, text_type: str = "qwen3", text_layers: int = 2,
                        hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                        tile_size: int = 32, patch_size: int = 8, max_patches: int = 6,
                        tie_word_embeddings: bool = False, vocab_size: int = 384, init_std: float = 0.08,
                        max_position_embeddings: int = 1024, add_bos: bool = True) -> Path:
    """Save a random InternVL (a 2-layer InternViT on `tile_size` tiles, downsample 0.5) with its
    processor; `text_type` is "qwen2" or "qwen3". Each tile gives (tile/patch)^2 / 4 tokens.
    `add_bos=False`: a tokenizer without BOS (the real InternVL3.5 ones have none)."""
    from transformers import (GenerationConfig, GotOcr2ImageProcessor, InternVLConfig,
                              InternVLForConditionalGeneration, InternVLProcessor, InternVLVideoProcessor,
                              InternVLVisionConfig)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", *INTERNVL_SPECIAL.values()]
    tokenizer = build_tokenizer(out, vocab_size, specials, INTERNVL_SPECIAL, add_bos=add_bos)
    image_token_id = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=[tile_size, tile_size], patch_size=[patch_size, patch_size],
                                  initializer_range=init_std, layer_scale_init_value=1.0)
    text = tiny_text_config(text_type, tokenizer, hidden_size=hidden, intermediate_size=hidden * 2,
                            num_hidden_layers=text_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden // num_heads,
                            max_position_embeddings=max_position_embeddings, initializer_range=init_std,
                            tie_word_embeddings=tie_word_embeddings)
    seq = (tile_size // patch_size) ** 2 // 4
    config = InternVLConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                            image_seq_length=seq, downsample_ratio=0.5, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF's init leaves the vision norms at 1/0; random ones test more
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0.0 if not name.endswith("norm.weight") and "lambda" not in name else 1.0, init_std)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    image_processor = GotOcr2ImageProcessor(size={"height": tile_size, "width": tile_size},
                                            crop_to_patches=True, min_patches=1, max_patches=max_patches)
    InternVLProcessor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=seq,
                      video_processor=InternVLVideoProcessor(size={"height": tile_size, "width": tile_size}),
                      chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def internvl_hub_key(key: str) -> str:
    """A key as the OpenGVLab/InternVL3_5-*-HF repos store it (saved by transformers 4.5x, whose
    InternVLForConditionalGeneration held `vision_tower`, `multi_modal_projector` and
    `language_model` at the top, the decoder under `language_model.model`, the head at
    `language_model.lm_head`); written independently of mmkit's loader."""
    if key.startswith("model."):
        key = key[len("model."):]
    if key.startswith("language_model.") and not key.startswith(("language_model.model.", "language_model.lm_head.")):
        return "language_model.model." + key[len("language_model."):]
    if key.startswith("lm_head."):
        return "language_model." + key
    return key


def rewrite_internvl_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights in the hub layout: 4.x key names, bf16, sharded with an index,
    `rope_theta` at the top of the text config."""
    return rewrite_hub_layout(src, dst, num_shards, key_fn=internvl_hub_key, dtype=torch.bfloat16,
                              transformers_version="4.52.0.dev0")
