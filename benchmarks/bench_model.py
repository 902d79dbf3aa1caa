"""The benchmark LLaVA: a SmolLM2-135M-shaped decoder (30 layers, hidden 576, 9 heads,
3 KV heads, vocab 49152, tied embeddings) behind a small CLIP tower, random weights, built
offline and cached under benchmarks/.cache/."""

from __future__ import annotations

from pathlib import Path

from mmkit.testing import SPECIAL_TOKENS, build_tiny_llava

ROOT = Path(__file__).resolve().parent


def build_full_vocab_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer whose vocabulary really has `vocab_size` entries (every
    id the random model can emit decodes), built from synthetic two-symbol merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})


def build_bench_llava(out_dir: str | Path | None = None, *, num_layers: int = 30, seed: int = 0,
                      image_size: int = 224) -> Path:
    """`image_size` sets the CLIP tower's input (patch 16): 224 px = 196 image tokens per
    image, 96 px = 36 (the decode-heavy workload's "a few dozen")."""
    suffix = "" if image_size == 224 else f"-img{image_size}"
    out = Path(out_dir) if out_dir else ROOT / ".cache" / f"bench-llava-{num_layers}l{suffix}"
    if (out / "config.json").exists():
        return out
    path = build_tiny_llava(out, seed=seed, num_kv_heads=3, tie_word_embeddings=True, text_layers=num_layers,
                            hidden=576, num_heads=9, intermediate=1536, image_size=image_size, patch_size=16,
                            max_position_embeddings=2048, init_std=0.02, vocab_size=49152,
                            tokenizer=build_full_vocab_tokenizer(49152))
    return path


if __name__ == "__main__":
    print(build_bench_llava())
