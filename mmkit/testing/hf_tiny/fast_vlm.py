"""Tiny random FastVLM checkpoints (FastViT-HD hybrid tower through timm: convolutional
RepMixer stages then attention stages, 64x downsampling, a final conv; a two-layer projector;
Qwen 2 decoder), built offline with transformers' own classes (the tower is
TimmWrapperModel, timm's architecture built from its config, nothing downloaded) and
LlavaProcessor, as the released -hf checkpoints ship it."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.hf_tiny.common import build_tokenizer, randomize_constant_weights, save_checkpoint

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
PLACEHOLDER = "<image>"
# "base": 128-pixel images (4 tokens), tied embeddings; "large": 192-pixel images (9 tokens),
# 3 heads on 1 KV head, untied, deeper stages.
CONFIGS = {
    "base": dict(hidden=64, num_heads=4, num_kv_heads=2, text_layers=2, image_size=128, stage_layers=(1, 1, 1, 1, 1),
                 tie_word_embeddings=True),
    "large": dict(hidden=48, num_heads=3, num_kv_heads=1, text_layers=3, image_size=192,
                  stage_layers=(1, 1, 2, 1, 1), tie_word_embeddings=False),
}


def build_tiny_fast_vlm(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, num_heads: int = 4,
                        num_kv_heads: int = 2, text_layers: int = 2, image_size: int = 128,
                        stage_layers: tuple[int, ...] = (1, 1, 1, 1, 1), tie_word_embeddings: bool = True,
                        init_std: float = 0.2) -> Path:
    """Save a random FastVlmForConditionalGeneration with its LlavaProcessor; an image is
    resized to `image_size` square and gives (image_size / 64)^2 `<image>` tokens."""
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
    embed_dims = (16, 16, 32, 32, 32)
    vision = tf.TimmWrapperConfig(architecture="fastvit_mci3", do_pooling=False, global_pool="avg",
                                  hidden_size=2 * embed_dims[-1], initializer_range=init_std,
                                  model_args={"inference_mode": True, "layers": tuple(stage_layers),
                                              "embed_dims": embed_dims})
    config = tf.FastVlmConfig(vision_config=vision, text_config=text,
                              image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                              image_seq_length=(image_size // 64) ** 2, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = tf.FastVlmForConditionalGeneration(config).eval()
    randomize_constant_weights(model)
    image_processor = tf.CLIPImageProcessor(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=64,
                                  num_additional_image_tokens=0, vision_feature_select_strategy="full")
    return save_checkpoint(out, model, processor, tokenizer)
