"""Tiny random LLaVA-NeXT and LLaVA-OneVision checkpoints, built offline with transformers'
own config, model and processor classes (anyres pinpoints sized for 32 px views)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import CHAT_TEMPLATE, build_tokenizer, tiny_text_config, tiny_vision

# (height, width) resolutions the image processor may tile to: 1x2, 2x1, 2x2, 1x3, 3x3 views.
PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 96]]

# The parity tests' second configurations (tests/models/llava/test_llava_second_config.py):
# other decoder, tower, feature layers and tie flag (both config levels) than the defaults of
# `mmkit.testing._BUILDERS`, 3 heads on 1 KV head (GQA ratio 3) with head_dim 24 / 40 != hidden /
# heads, 3 layers, no BOS token. (OneVision keeps SigLIP with every row: transformers' own
# OneVision counts one feature row more than its processor writes with CLIP's CLS dropped.)
SECOND_CONFIGS = {
    "LlavaNextForConditionalGeneration": dict(
        family="llava_next", text_type="qwen3", vision_type="siglip", select_strategy="full",
        vision_feature_layer=[-3, -1], num_heads=3, num_kv_heads=1, head_dim=24, text_layers=3,
        tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False),
    "LlavaOnevisionForConditionalGeneration": dict(
        family="llava_onevision", text_type="llama", vision_type="siglip", select_strategy="full",
        vision_feature_layer=-2, vision_aspect_ratio="anyres_max_9", hidden=72, num_heads=3, num_kv_heads=1,
        head_dim=40, text_layers=3, tie_word_embeddings=False, text_tie_word_embeddings=True, add_bos=False),
}


def build_tiny_anyres(out_dir: str | Path, family: str = "llava_next", *, seed: int = 0,
                      text_type: str = "llama", vision_type: str = "clip", select_strategy: str = "default",
                      vision_feature_layer: int | list[int] = -2, num_kv_heads: int = 2,
                      tie_word_embeddings: bool = False, image_size: int = 32, patch_size: int = 8,
                      vision_aspect_ratio: str = "anyres_max_4", hidden: int = 64, num_heads: int = 4,
                      head_dim: int | None = None, text_layers: int = 2, add_bos: bool = True) -> Path:
    """Save a random `family` ("llava_next" or "llava_onevision") checkpoint with its processor
    (`head_dim` default hidden / heads; `add_bos=False`: a tokenizer without BOS)."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, add_bos=add_bos)
    if family == "llava_onevision":  # its processor names a video token, as the real ones do
        tokenizer.add_tokens(["<video>"], special_tokens=True)
    vision, _, num_additional = tiny_vision(vision_type, image_size, patch_size)
    text = tiny_text_config(text_type, tokenizer, hidden_size=hidden, intermediate_size=hidden * 2,
                            num_hidden_layers=text_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden // num_heads,
                            max_position_embeddings=1024, tie_word_embeddings=tie_word_embeddings,
                            initializer_range=0.08)
    common = dict(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                  vision_feature_layer=vision_feature_layer, vision_feature_select_strategy=select_strategy,
                  image_grid_pinpoints=PINPOINTS, tie_word_embeddings=tie_word_embeddings)
    if family == "llava_next":
        config = tf.LlavaNextConfig(**common)
        model_cls = tf.LlavaNextForConditionalGeneration
        image_processor = tf.LlavaNextImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
            image_grid_pinpoints=PINPOINTS)
        processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                          vision_feature_select_strategy=select_strategy,
                                          num_additional_image_tokens=num_additional, chat_template=CHAT_TEMPLATE)
    else:
        config = tf.LlavaOnevisionConfig(vision_aspect_ratio=vision_aspect_ratio, **common)
        model_cls = tf.LlavaOnevisionForConditionalGeneration
        image_processor = tf.LlavaOnevisionImageProcessor(size={"height": image_size, "width": image_size},
                                                          image_grid_pinpoints=PINPOINTS)
        processor = tf.LlavaOnevisionProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=tf.LlavaOnevisionVideoProcessor(),
            num_image_tokens=(image_size // patch_size) ** 2, vision_feature_select_strategy=select_strategy,
            vision_aspect_ratio=vision_aspect_ratio, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF initialises image_newline to zeros-ish; make it matter
        model.model.image_newline.normal_(0, 0.5)
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    processor.save_pretrained(out)
    return out
