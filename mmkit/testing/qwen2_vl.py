"""Build tiny random Qwen2-VL / Qwen2.5-VL checkpoints offline with transformers' own classes.

The tokenizer is trained here with `tokenizers` and carries Qwen's vision special tokens; the
processor (Qwen2VLProcessor: image processor with small min/max_pixels, video processor,
chat template) is saved beside the weights, so `AutoProcessor` loads it as for a hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.checkpoint_io import read_checkpoint, save_sharded

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template, cut to what the tests use (text, image and video parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\nA red circle.<|im_end|>",
    "Describe the picture in detail, please. The quick brown fox jumps over the lazy dog.",
    "How many shapes are there? two. What color is the square? blue. Is there a triangle? yes.",
    "Write a haiku about the sea. Waves fold into foam; salt wind carries gull voices.",
    "Describe this video. A ball rolls from left to right, then stops near the wall.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" the a an of to in is it that",
]
# The parity tests' second configuration (tests/models/qwen2_vl/test_qwen2_vl_second_config.py):
# 3 heads on 1 KV head (GQA ratio 3) of head_dim 24, uneven M-RoPE sections (2, 4, 6), 3 layers,
# a 3-block tower with 3 heads, tied embeddings (both config levels). (Qwen's tokenizer has no
# BOS token in either configuration.)
SECOND_CONFIGS = {arch: dict(version=version, hidden=72, num_heads=3, num_kv_heads=1, mrope_section=[2, 4, 6],
                             text_layers=3, vision_depth=3, vision_dim=48, vision_heads=3, vision_mlp_ratio=3,
                             tie_word_embeddings=True, text_tie_word_embeddings=False)
                  for arch, version in (("Qwen2VLForConditionalGeneration", "2"),
                                        ("Qwen2_5_VLForConditionalGeneration", "2.5"))}


def build_qwen_tokenizer(out_dir: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens={"image_token": "<|image_pad|>",
                                                         "video_token": "<|video_pad|>",
                                                         "vision_bos_token": "<|vision_start|>",
                                                         "vision_eos_token": "<|vision_end|>"})
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_qwen2_vl(out_dir: str | Path, *, seed: int = 0, version: str = "2", text_layers: int = 2,
                        hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, vision_depth: int = 2,
                        vision_dim: int = 32, patch_size: int = 8, min_pixels: int = 16 * 16 * 4,
                        max_pixels: int = 16 * 16 * 16, tie_word_embeddings: bool = False,
                        max_position_embeddings: int = 1024, init_std: float = 0.08, intermediate: int | None = None,
                        vision_heads: int = 4, vision_mlp_ratio: int = 2, mrope_section: list[int] | None = None,
                        tokenizer=None) -> Path:
    """Save a random Qwen2-VL (`version="2"`) or Qwen2.5-VL (`"2.5"`) with its processor.

    Images are patchified at `patch_size` and merged 2x2, so one image token covers
    (2 * patch_size)^2 pixels; min/max_pixels bound the resized image as in the real models.
    """
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_qwen_tokenizer(out)
    else:
        tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // num_heads
    # M-RoPE splits head_dim / 2 rotary frequencies into (temporal, height, width) sections.
    quarter = head_dim // 2
    mrope_section = mrope_section or [quarter - 2 * (quarter * 3 // 8), quarter * 3 // 8, quarter * 3 // 8]
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                num_hidden_layers=text_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], initializer_range=init_std,
                tie_word_embeddings=tie_word_embeddings)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=tie_word_embeddings)
    if version == "2":
        vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=vision_heads,
                      mlp_ratio=vision_mlp_ratio,
                      patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
                      initializer_range=init_std)
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        model_cls, image_cls, video_cls, proc_cls = (tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLImageProcessor,
                                                     tf.Qwen2VLVideoProcessor, tf.Qwen2VLProcessor)
    else:
        # Window attention over (window_size / patch_size)^2-patch windows, except fullatt blocks.
        vision = dict(depth=vision_depth, hidden_size=vision_dim, out_hidden_size=hidden, num_heads=vision_heads,
                      intermediate_size=vision_dim * 2, patch_size=patch_size, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=patch_size * 4,
                      fullatt_block_indexes=[vision_depth - 1], initializer_range=init_std)
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        model_cls, image_cls, video_cls, proc_cls = (tf.Qwen2_5_VLForConditionalGeneration,
                                                     tf.Qwen2VLImageProcessor, tf.Qwen2VLVideoProcessor,
                                                     tf.Qwen2_5_VLProcessor)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                        pad_token_id=text["pad_token_id"]).save_pretrained(out)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = image_cls(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2)
    video_processor = video_cls(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                                do_sample_frames=False)
    processor = proc_cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                         chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def rewrite_qwen_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights in the layout of the Qwen2-VL repos on the hub (`visual.*`, `model.layers.*`,
    `model.embed_tokens.*`, `lm_head.weight`), sharded with an index, and the hub's config.json
    form (transformers 4.4x: text fields at the top level, `rope_scaling: {"type": "mrope"}`,
    `rope_theta`, a vision config without `model_type` and with `in_chans`)."""
    import json

    src, dst = Path(src), Path(dst)
    state = read_checkpoint(src, dst)
    renamed = {}
    for key, tensor in state.items():
        if key.startswith("model.visual."):
            key = key[len("model."):]
        elif key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        renamed[key] = tensor.contiguous()
    save_sharded(renamed, dst, num_shards)
    config = json.loads((src / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key, None)
    vision = config["vision_config"]
    vision.pop("model_type", None)
    vision.pop("rope_parameters", None)
    vision["in_chans"] = vision.pop("in_channels", 3)
    config.update(text)
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
                  torch_dtype="bfloat16", transformers_version="4.45.0")
    config.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
