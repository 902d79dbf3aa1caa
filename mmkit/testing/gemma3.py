"""Tiny random Gemma 3 checkpoints (SigLIP tower, Gemma3MultiModalProjector, Gemma 3 decoder
with sliding and global layers), built offline with transformers' own config, model and
processor classes (Gemma3Processor with `<start_of_image>` / `<image_soft_token>` /
`<end_of_image>` and Gemma3ImageProcessor, whose pan-and-scan crops are extra images)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmkit.testing.llava import build_tokenizer, rewrite_hub_layout

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
                  "<start_of_turn>", "<end_of_turn>"]
IMAGE_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
# Gemma 3's turn layout; an image part is the `<start_of_image>` placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# The parity tests' second configuration (tests/models/gemma3/test_gemma3_second_config.py):
# 3 heads on 1 KV head (GQA ratio 3) of head_dim 40 (!= hidden / heads), query_pre_attn_scalar 32,
# 4 layers with every third global and a 24-token window the prompts outgrow, unscaled global
# rotary, final logit soft-capping, 4 soft tokens per image, tied embeddings (both config
# levels), no BOS token; init_std 0.02 (at 0.2 the tied head's argmax is one token whatever the prompt).
SECOND_CONFIGS = {"Gemma3ForConditionalGeneration": dict(
    hidden=72, num_heads=3, num_kv_heads=1, head_dim=40, text_layers=4, sliding_window_pattern=3, sliding_window=24,
    rope_scaling_factor=None, final_logit_softcapping=30.0, query_pre_attn_scalar=32, mm_tokens_per_image=4,
    init_std=0.02, tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False)}


def build_tiny_gemma3(out_dir: str | Path, *, seed: int = 0, text_layers: int = 3, hidden: int = 64,
                      num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, image_size: int = 32,
                      patch_size: int = 4, mm_tokens_per_image: int = 16, sliding_window: int = 512,
                      sliding_window_pattern: int = 2, rope_scaling_factor: float | None = 2.0,
                      final_logit_softcapping: float | None = None, query_pre_attn_scalar: int = 24,
                      max_position_embeddings: int = 1024, init_std: float = 0.2,
                      tie_word_embeddings: bool = False, add_bos: bool = True) -> Path:
    """Save a random Gemma3ForConditionalGeneration with its Gemma3Processor. Every
    `sliding_window_pattern`-th layer is global (the others slide over `sliding_window` tokens);
    the global layers' rotary is scaled linearly by `rope_scaling_factor` (None: unscaled) with
    base 1e6, the local ones use base 1e4 (released checkpoints tie the LM head to the
    embeddings; untied random weights give livelier greedy text). An image (or pan-and-scan
    crop) is resized to `image_size` square and gives `mm_tokens_per_image` soft tokens
    (patches average-pooled). `add_bos=False`: a tokenizer without BOS."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, special_tokens=SPECIAL_TOKENS, extra_special_tokens=IMAGE_TOKENS,
                                add_bos=add_bos)
    layer_types = ["full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention"
                   for i in range(text_layers)]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    if rope_scaling_factor is not None:
        rope["full_attention"] = {"rope_type": "linear", "factor": rope_scaling_factor, "rope_theta": 1_000_000.0}
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                               num_hidden_layers=text_layers, num_attention_heads=num_heads,
                               num_key_value_heads=num_kv_heads, head_dim=head_dim,
                               query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=sliding_window,
                               layer_types=layer_types, rope_parameters=rope,
                               final_logit_softcapping=final_logit_softcapping,
                               max_position_embeddings=max_position_embeddings, initializer_range=init_std,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=image_size, patch_size=patch_size, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
                             boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                             eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
                             image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
                             initializer_range=init_std, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    _randomize_zero_inits(model, init_std)
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    image_processor = tf.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                   image_seq_length=mm_tokens_per_image, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


@torch.no_grad()
def _randomize_zero_inits(model, std: float) -> None:
    """Gemma 3 initialises its (1 + w) norms and the projector matrix to zeros; random values
    make a test see a norm or projection computed wrongly."""
    generator = torch.Generator().manual_seed(1234)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and "vision_tower" not in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        elif name.endswith("mm_input_projection_weight"):
            param.copy_(torch.randn(param.shape, generator=generator) * std * 4)


def rewrite_gemma3_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights as the transformers-4.x Gemma 3 repos hold them: LLaVA's key layout
    (`language_model.model.*`, `vision_tower.vision_model.*`), bfloat16, sharded, and the text
    config in the 4.x keys (`rope_theta`, `rope_local_base_freq`, `rope_scaling` of the global
    layers, `sliding_window_pattern` instead of `layer_types`)."""
    src, dst = Path(src), Path(dst)
    rewrite_hub_layout(src, dst, num_shards, dtype=torch.bfloat16, transformers_version="4.50.0.dev0")
    saved = json.loads((src / "config.json").read_text())["text_config"]
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    text.pop("_sliding_window_pattern", None)
    rope = saved["rope_parameters"]
    text["rope_theta"] = rope["full_attention"]["rope_theta"]
    text["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    scaling = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    text["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    layer_types = text.pop("layer_types")
    pattern = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else len(layer_types) + 1
    text["sliding_window_pattern"] = pattern
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
