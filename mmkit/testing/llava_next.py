"""Tiny random LLaVA-NeXT and LLaVA-OneVision checkpoints, built offline with transformers'
own config, model and processor classes (anyres pinpoints sized for 32 px views)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.llava import CHAT_TEMPLATE, build_tokenizer, tiny_text_config, tiny_vision

# (height, width) resolutions the image processor may tile to: 1x2, 2x1, 2x2, 1x3, 3x3 views.
PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 96]]


def build_tiny_anyres(out_dir: str | Path, family: str = "llava_next", *, seed: int = 0,
                      text_type: str = "llama", vision_type: str = "clip", select_strategy: str = "default",
                      vision_feature_layer: int | list[int] = -2, num_kv_heads: int = 2,
                      tie_word_embeddings: bool = False, image_size: int = 32, patch_size: int = 8,
                      vision_aspect_ratio: str = "anyres_max_4") -> Path:
    """Save a random `family` ("llava_next" or "llava_onevision") checkpoint with its processor."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    if family == "llava_onevision":  # its processor names a video token, as the real ones do
        tokenizer.add_tokens(["<video>"], special_tokens=True)
    vision, _, num_additional = tiny_vision(vision_type, image_size, patch_size)
    text = tiny_text_config(text_type, tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                            tie_word_embeddings=tie_word_embeddings, initializer_range=0.08)
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
