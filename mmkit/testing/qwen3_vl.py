"""Build tiny random Qwen3-VL / Qwen3-VL-MoE checkpoints offline with transformers' own classes.

The tokenizer and chat template are the Qwen2-VL builder's (same special tokens); the processor
is transformers' `Qwen3VLProcessor` (Qwen2-VL image processor, Qwen3-VL video processor that
samples frames and writes timestamps), saved beside the weights. The decoder has a head_dim
other than hidden / heads, interleaved M-RoPE and DeepStack on the first vision layers; the
MoE variant puts experts in some layers (`decoder_sparse_step`, `mlp_only_layers`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing.checkpoint_io import read_checkpoint, save_sharded
from mmkit.testing.qwen2_vl import CHAT_TEMPLATE, SPECIAL_TOKENS, build_qwen_tokenizer

# The parity tests' second configuration (tests/models/qwen3_vl/test_qwen3_vl_second_config.py):
# head_dim 40 (interleaved M-RoPE sections 8, 6, 6 instead of 4, 4, 4), 3 heads on 1 KV head
# (GQA ratio 3), 4 layers, DeepStack into layers 1 and 2, a 2-head tower, tied embeddings (both
# config levels); MoE in alternate layers (decoder_sparse_step 2, no mlp_only_layers), 6
# experts, 3 per token; init_std 0.2 (at 0.08 the tied head repeats one token). (Qwen's tokenizer
# has no BOS token in either configuration.)
_SECOND = dict(hidden=48, num_heads=3, num_kv_heads=1, head_dim=40, mrope_section=[8, 6, 6], text_layers=4,
               deepstack_visual_indexes=(1, 2), vision_heads=2, init_std=0.2, tie_word_embeddings=True, text_tie_word_embeddings=False)
SECOND_CONFIGS = {
    "Qwen3VLForConditionalGeneration": dict(moe=False, **_SECOND),
    "Qwen3VLMoeForConditionalGeneration": dict(moe=True, decoder_sparse_step=2, mlp_only_layers=(), num_experts=6,
                                               num_experts_per_tok=3, **_SECOND),
}


def build_tiny_qwen3_vl(out_dir: str | Path, *, seed: int = 0, moe: bool = False, text_layers: int = 3,
                        hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 24,
                        vision_depth: int = 3, vision_dim: int = 32, patch_size: int = 8,
                        deepstack_visual_indexes: tuple[int, ...] = (0, 1), min_pixels: int = 16 * 16 * 4,
                        max_pixels: int = 16 * 16 * 16, video_fps: float = 12.0, num_experts: int = 8,
                        num_experts_per_tok: int = 2, mlp_only_layers: tuple[int, ...] = (1,),
                        tie_word_embeddings: bool = False, max_position_embeddings: int = 2048,
                        init_std: float = 0.08, intermediate: int | None = None, vision_heads: int = 4,
                        vision_intermediate: int | None = None, num_position_embeddings: int = 64,
                        mrope_section: list[int] | None = None, decoder_sparse_step: int = 1,
                        tokenizer=None) -> Path:
    """Save a random Qwen3-VL (`moe=False`) or Qwen3-VL-MoE (`moe=True`) with its processor.
    A layer has experts unless it is in `mlp_only_layers` or (index + 1) is no multiple of
    `decoder_sparse_step`.

    One image token covers (2 * patch_size)^2 pixels; min/max_pixels bound the resized image;
    the video processor samples `video_fps` frames per second of clip."""
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_qwen_tokenizer(out)
    else:
        tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    half = head_dim // 2  # interleaved M-RoPE: sections of the head_dim / 2 frequencies
    section = mrope_section or [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                num_hidden_layers=text_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": section,
                                 "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], initializer_range=init_std,
                tie_word_embeddings=tie_word_embeddings)
    if moe:
        text.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=hidden // 2 - 8,
                    decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers))
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=vision_intermediate or vision_dim * 2,
                  num_heads=vision_heads, out_hidden_size=hidden, patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=num_position_embeddings, deepstack_visual_indexes=list(deepstack_visual_indexes),
                  initializer_range=init_std)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=tie_word_embeddings)
    config_cls, model_cls = ((tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration) if moe
                             else (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration))
    config = config_cls(text_config=text, vision_config=vision, **common)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if moe:  # transformers initialises experts with std 0.02 whatever initializer_range says
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.normal_(0.0, init_std)
    model.save_pretrained(out)
    save_generation_and_processor(out, text, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels,
                                  patch_size=patch_size, video_fps=video_fps)
    return out


def rewrite_qwen3_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights as the Qwen3-VL repos on the hub store them (saved by transformers
    4.57): sharded with an index, bf16-free config fields in their 4.x names (`rope_scaling`,
    `rope_theta` in the text config) and, for MoE, the experts transposed to `[E, H, 2I]` /
    `[E, I, H]`."""
    import json

    src, dst = Path(src), Path(dst)
    state = read_checkpoint(src, dst)
    state = {k: (v.transpose(1, 2) if ".mlp.experts." in k else v).contiguous() for k, v in state.items()}
    save_sharded(state, dst, num_shards)
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    for part in (text, config["vision_config"]):
        part.pop("dtype", None)
    config.pop("dtype", None)
    config.update(torch_dtype="float32", transformers_version="4.57.0")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def save_generation_and_processor(out: Path, text: dict, tokenizer, *, min_pixels: int, max_pixels: int,
                                  patch_size: int, video_fps: float) -> None:
    """The generation config (ids from the text config dict) and the Qwen3-VL processor (image and
    video processors at these sizes, the shared chat template), as transformers saves them; the
    Qwen3.5 builder writes the same processor."""
    import transformers as tf

    tf.GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                        pad_token_id=text["pad_token_id"]).save_pretrained(out)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = tf.Qwen2VLImageProcessor(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2)
    video_processor = tf.Qwen3VLVideoProcessor(size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                                               fps=video_fps, min_frames=2, cap_pixels_per_frame=False)
    processor = tf.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
