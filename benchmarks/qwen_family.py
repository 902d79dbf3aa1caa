"""`--family qwen2_vl` / `qwen3_vl` of the side-by-side benchmarks: a Qwen2-VL-2B- or
Qwen3-VL-2B-shaped random checkpoint, its prompts and transformers' own model class in
left-padded static batches.

Qwen3-VL-2B's shape: decoder hidden 2048, 16 heads, 8 KV heads, head_dim 128, MLP 6144, tied,
interleaved M-RoPE 24/20/20; vision hidden 1024, 16 heads, MLP 4096, patch 16, 2x2 merge,
48x48 learned positions, DeepStack from 3 vision layers (here the first three of the cut
tower). Images of 224x224 are 7x7 = 49 tokens there.

The checkpoint: Qwen2-VL-2B's decoder shape (hidden 1536, 12 heads, 2 KV heads, MLP 8960,
tied embeddings, vocab 151936, M-RoPE sections 16/24/24) and vision shape (embed 1280, 16
heads, patch 14, 2x2 merge), with the decoder and vision depths cut (`--num-layers`,
`--vision-depth`) as the LLaVA benchmark model is small; random weights, built offline and
cached under benchmarks/.cache/. Images are 224x224: 8x8 = 64 tokens each.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent

import common  # noqa: E402
from mmkit.testing.qwen2_vl import SPECIAL_TOKENS, build_tiny_qwen2_vl  # noqa: E402

VOCAB_SIZE = 151936
IMAGE_SIZE = 224
FIRST_TEXT_ID = len(SPECIAL_TOKENS)  # ids below are Qwen's special tokens


def build_full_vocab_qwen_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE whose vocabulary really has `vocab_size` entries (every id the random
    model emits decodes): Qwen's special tokens, the byte alphabet, then synthetic merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    merges = []
    pairs = [(a, b) for a in alphabet for b in alphabet]
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in [*pairs, *triples]:
        if len(vocab) >= vocab_size:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens={"image_token": "<|image_pad|>",
                                                         "video_token": "<|video_pad|>"})


def build_bench_qwen2_vl(num_layers: int, vision_depth: int) -> str:
    out = ROOT / ".cache" / f"bench-qwen2vl-{num_layers}l-{vision_depth}v"
    if not (out / "config.json").exists():
        build_tiny_qwen2_vl(out, seed=0, text_layers=num_layers, hidden=1536, num_heads=12, num_kv_heads=2,
                            intermediate=8960, vision_depth=vision_depth, vision_dim=1280, vision_heads=16,
                            vision_mlp_ratio=4, patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                            tie_word_embeddings=True, max_position_embeddings=4096, init_std=0.02,
                            mrope_section=[16, 24, 24], tokenizer=build_full_vocab_qwen_tokenizer())
    return str(out)


def build_qwen2_vl_2b_hub(num_layers: int = 28, vision_depth: int = 32) -> str:
    """`peers.py --shape qwen2-vl-2b`: the Qwen2-VL-2B shape above (full depth: 28 decoder layers,
    32 vision blocks, about 2.2B parameters), random weights in bf16 as the hub ships them, in the
    hub's layout (`visual.*`, `model.layers.*`; transformers-4.x config.json), which vLLM 0.32 and
    mmkit both load. Built once under benchmarks/.cache/; transformers' own class builds it (in
    bf16 from the start: a float32 copy of the full depth would hold 8.8 GB of memory)."""
    import shutil

    from mmkit.testing.qwen2_vl import rewrite_qwen_hub_layout

    out = ROOT / ".cache" / f"bench-qwen2vl-2b-{num_layers}l-{vision_depth}v-hub"
    if (out / "config.json").exists():
        return str(out)
    src = ROOT / ".cache" / f"bench-qwen2vl-2b-{num_layers}l-{vision_depth}v-build"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        build_tiny_qwen2_vl(src, seed=0, text_layers=num_layers, hidden=1536, num_heads=12, num_kv_heads=2,
                            intermediate=8960, vision_depth=vision_depth, vision_dim=1280, vision_heads=16,
                            vision_mlp_ratio=4, patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                            tie_word_embeddings=True, max_position_embeddings=32768, init_std=0.02,
                            mrope_section=[16, 24, 24], tokenizer=build_full_vocab_qwen_tokenizer())
    finally:
        torch.set_default_dtype(default)
    rewrite_qwen_hub_layout(src, out, num_shards=max(1, num_layers // 8))
    shutil.rmtree(src)  # the transformers-5 layout was only the rewrite's input
    return str(out)


def build_bench_qwen3_vl(num_layers: int, vision_depth: int) -> str:
    from mmkit.testing.qwen3_vl import build_tiny_qwen3_vl

    out = ROOT / ".cache" / f"bench-qwen3vl-{num_layers}l-{vision_depth}v"
    if not (out / "config.json").exists():
        build_tiny_qwen3_vl(out, seed=0, text_layers=num_layers, hidden=2048, num_heads=16, num_kv_heads=8,
                            head_dim=128, intermediate=6144, vision_depth=vision_depth, vision_dim=1024,
                            vision_heads=16, vision_intermediate=4096, patch_size=16,
                            num_position_embeddings=2304, deepstack_visual_indexes=tuple(range(min(3, vision_depth))),
                            min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 1280, tie_word_embeddings=True,
                            max_position_embeddings=4096, init_std=0.02, mrope_section=[24, 20, 20],
                            tokenizer=build_full_vocab_qwen_tokenizer())
    return str(out)


def build_bench_qwen3_5(num_layers: int, vision_depth: int) -> str:
    """Qwen3.5-2B-shaped, depth cut: hidden 2048, MLP 6144, full attention 8 heads / 2 KV heads of
    256 with a quarter rotated, Gated DeltaNet 16 key / 16 value heads of 128, conv kernel 4, three
    linear-attention layers to one full-attention layer; tower hidden 1024 / 16 heads, patch 16.
    (The shape is assumed from the family's published pattern, not read from the 2B's config;
    the tokenizer is the 151936-entry one above, not Qwen3.5's 248320.)"""
    from mmkit.testing.qwen3_5 import build_tiny_qwen3_5

    out = ROOT / ".cache" / f"bench-qwen3_5-{num_layers}l-{vision_depth}v"
    if not (out / "config.json").exists():
        build_tiny_qwen3_5(out, seed=0, text_layers=num_layers, full_attention_every=4, hidden=2048, num_heads=8,
                           num_kv_heads=2, head_dim=256, partial_rotary_factor=0.25, linear_key_heads=16,
                           linear_value_heads=16, linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
                           intermediate=6144, vision_depth=vision_depth, vision_dim=1024, vision_heads=16,
                           vision_intermediate=4096, patch_size=16, num_position_embeddings=2304,
                           min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 1280, tie_word_embeddings=True,
                           max_position_embeddings=4096, init_std=0.02, tokenizer=build_full_vocab_qwen_tokenizer())
    return str(out)


def _ids(r: common.Request) -> list[int]:
    return [t if t >= FIRST_TEXT_ID else t + FIRST_TEXT_ID for t in r.text_ids]


def mmkit_inputs(reqs: list[common.Request], image_size: int = IMAGE_SIZE) -> list[dict]:
    vs, pad, ve = (SPECIAL_TOKENS.index(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    return [{"prompt_token_ids": [vs, pad, ve] + _ids(r),
             "multi_modal_data": {"image": common.make_image(r.image_seed, image_size)}} for r in reqs]


class QwenHFRunner:
    """transformers' own class (Qwen2-VL / Qwen3-VL).generate in left-padded static batches."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), local_files_only=True).eval()
        self.dtype = getattr(torch, dtype)
        self.pad_id = self.processor.tokenizer.pad_token_id

    def batch_inputs(self, reqs: list[common.Request]) -> dict:
        images = [common.make_image(r.image_seed, IMAGE_SIZE) for r in reqs]
        vision = self.processor.image_processor(images=images, return_tensors="pt")
        num_tokens = [int(g.prod()) // 4 for g in vision["image_grid_thw"]]
        vs, pad, ve = (SPECIAL_TOKENS.index(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
        ids = [[vs] + [pad] * n + [ve] + _ids(r) for r, n in zip(reqs, num_tokens)]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        types = torch.zeros((len(ids), width), dtype=torch.int)
        for i, x in enumerate(ids):  # left padding
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
            types[i, width - len(x) + 1:width - len(x) + 1 + num_tokens[i]] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types,
                "pixel_values": vision["pixel_values"].to(self.dtype), "image_grid_thw": vision["image_grid_thw"]}

    @torch.inference_mode()
    def generate(self, reqs: list[common.Request], max_new_tokens: int | None = None, streamer=None) -> torch.Tensor:
        inputs = self.batch_inputs(reqs)
        n = max_new_tokens or max(r.max_tokens for r in reqs)
        out = self.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.pad_id, streamer=streamer)
        return out[:, inputs["input_ids"].shape[1]:]

    def run_static(self, reqs: list[common.Request], batch_size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(reqs), batch_size):
            self.generate(reqs[i:i + batch_size])
        return time.perf_counter() - start
