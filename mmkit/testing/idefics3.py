"""Tiny random Idefics3 and SmolVLM checkpoints (vision transformer, pixel-shuffle connector,
Llama decoder), built offline with transformers' own config, model and processor classes
(tiles of `max_image_size` plus the global view; SmolVLM with its video processor)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import build_tokenizer, rewrite_hub_layout

LAYOUT_TOKENS = (["<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<video>"]
                 + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])

# The parity tests' second configuration (tests/models/idefics3/test_idefics3_second_config.py):
# 3 heads on 1 KV head (GQA ratio 3) of head_dim 40 (!= hidden / heads), 3 layers, 48 px tiles
# (9 tokens a view) up to 96 px, tied embeddings (both config levels), no BOS token.
_SECOND = dict(hidden=72, num_heads=3, num_kv_heads=1, head_dim=40, text_layers=3, tile_size=48, longest_edge=96,
               tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False)
SECOND_CONFIGS = {"Idefics3ForConditionalGeneration": dict(family="idefics3", **_SECOND),
                  "SmolVLMForConditionalGeneration": dict(family="smolvlm", **_SECOND)}


def build_tiny_idefics3(out_dir: str | Path, family: str = "smolvlm", *, seed: int = 0, text_layers: int = 2,
                        hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, tile_size: int = 32,
                        patch_size: int = 8, longest_edge: int = 64, do_image_splitting: bool = True,
                        max_position_embeddings: int = 2048, init_std: float = 0.08,
                        tie_word_embeddings: bool = False, head_dim: int | None = None,
                        add_bos: bool = True) -> Path:
    """Save a random `family` ("idefics3" or "smolvlm") checkpoint with its processor. An image
    is resized to at most `longest_edge`, split into `tile_size` tiles plus a global view; each
    view gives (tile_size / patch_size)^2 / 4 tokens (2x2 pixel shuffle). `head_dim` (default
    hidden / heads) need not be hidden / heads; `add_bos=False`: a tokenizer without BOS."""
    import transformers as tf
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, add_bos=add_bos)
    tokenizer.add_tokens(LAYOUT_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(out)
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                          num_hidden_layers=text_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden // num_heads,
                          max_position_embeddings=max_position_embeddings,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, initializer_range=init_std,
                          tie_word_embeddings=tie_word_embeddings)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=tile_size, patch_size=patch_size, initializer_range=init_std)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    image_kwargs = dict(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile_size},
                        do_image_splitting=do_image_splitting)
    if family == "idefics3":
        config = tf.Idefics3Config(vision_config=tf.Idefics3VisionConfig(**vision), text_config=text, scale_factor=2,
                                   image_token_id=image_token_id, tie_word_embeddings=tie_word_embeddings)
        model_cls = tf.Idefics3ForConditionalGeneration
        processor = tf.Idefics3Processor(image_processor=tf.Idefics3ImageProcessor(**image_kwargs),
                                         tokenizer=tokenizer, image_seq_len=(tile_size // patch_size) ** 2 // 4,
                                         chat_template=DEFAULT_CHAT_TEMPLATE)
    else:
        config = tf.SmolVLMConfig(vision_config=tf.SmolVLMVisionConfig(**vision), text_config=text, scale_factor=2,
                                  image_token_id=image_token_id, tie_word_embeddings=tie_word_embeddings)
        model_cls = tf.SmolVLMForConditionalGeneration
        video_processor = tf.SmolVLMVideoProcessor(size={"longest_edge": tile_size},
                                                   max_image_size={"longest_edge": tile_size})
        processor = tf.SmolVLMProcessor(image_processor=tf.SmolVLMImageProcessor(**image_kwargs), tokenizer=tokenizer,
                                        video_processor=video_processor,
                                        image_seq_len=(tile_size // patch_size) ** 2 // 4,
                                        chat_template=DEFAULT_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def rewrite_idefics3_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights as the 4.x hub repos hold them: the key names transformers 4.x wrote
    (`model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.weight`),
    fp16, sharded with an index, `rope_theta` in the text config."""
    return rewrite_hub_layout(src, dst, num_shards, key_fn=lambda key: key)
