"""Tiny random Mistral 3 checkpoints (Pixtral tower, patch merger, Mistral decoder), built
offline with transformers' own config, model and processor classes (PixtralProcessor with the
[IMG] / [IMG_BREAK] / [IMG_END] tokens)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import build_tokenizer, hub_key, rewrite_hub_layout

IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}[IMG]{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{{ part['text'] }}{% endfor %}{% endif %}{{ eos_token }}{% endif %}{% endfor %}"
)
# The parity tests' second configuration (tests/models/mistral3/test_mistral3_second_config.py):
# 3 heads on 1 KV head (GQA ratio 3) of head_dim 40 (!= hidden / heads), 3 layers, a 24-token
# sliding window the prompts outgrow, the tower's second-to-last layer, tied embeddings (both
# config levels), no BOS token. (A list of feature layers is no option: transformers' own
# Mistral 3 projector norm then has the wrong width.)
SECOND_CONFIGS = {"Mistral3ForConditionalGeneration": dict(
    hidden=72, num_heads=3, num_kv_heads=1, head_dim=40, text_layers=3, sliding_window=24, vision_feature_layer=-2,
    tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False)}


def build_tiny_mistral3(out_dir: str | Path, *, seed: int = 0, text_layers: int = 2, hidden: int = 64,
                        num_heads: int = 4, num_kv_heads: int = 2, patch_size: int = 8, longest_edge: int = 96,
                        sliding_window: int | None = None, max_position_embeddings: int = 1024,
                        vision_feature_layer: int | list[int] = -1, init_std: float = 0.08,
                        tie_word_embeddings: bool = False, head_dim: int | None = None,
                        add_bos: bool = True) -> Path:
    """Save a random Mistral3ForConditionalGeneration with its PixtralProcessor. Images are
    resized to at most `longest_edge` pixels and merged 2x2, so a token covers 2 * patch_size
    pixels square; `sliding_window` sets the decoder's window (None: full attention); `head_dim`
    (default hidden / heads) need not be hidden / heads; `add_bos=False`: a tokenizer without BOS."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, add_bos=add_bos)
    tokenizer.add_tokens(IMAGE_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(out)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    head_dim=8, image_size=longest_edge, patch_size=patch_size,
                                    initializer_range=init_std)
    text = tf.MistralConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                            num_hidden_layers=text_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden // num_heads,
                            max_position_embeddings=max_position_embeddings, sliding_window=sliding_window,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, initializer_range=init_std,
                            tie_word_embeddings=tie_word_embeddings)
    config = tf.Mistral3Config(vision_config=vision, text_config=text,
                               image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                               vision_feature_layer=vision_feature_layer, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    image_processor = tf.PixtralImageProcessor(size={"longest_edge": longest_edge},
                                               patch_size={"height": patch_size, "width": patch_size})
    processor = tf.PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                    spatial_merge_size=2, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def mistral3_hub_key(key: str) -> str:
    """A key as the transformers-4.x Mistral 3 repos store it: LLaVA's layout with the Pixtral
    tower's own names (`vision_tower.transformer.*`, no `vision_model` level)."""
    key = hub_key(key)
    return key.replace("vision_tower.vision_model.", "vision_tower.", 1)


def rewrite_mistral3_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights as the 4.x hub repos hold them (fp16, sharded, `rope_theta`)."""
    return rewrite_hub_layout(src, dst, num_shards, key_fn=mistral3_hub_key)
