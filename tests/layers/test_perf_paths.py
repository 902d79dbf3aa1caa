"""The fast paths: heads-first paged attention, fused q/k/v and gate/up weights, bf16 packed
matmuls, and the CUDA path of the same code (CUDA tests skip without a GPU)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import CUDA_ONLY, hf_greedy
from mmkit import SamplingParams
from mmkit.layers.attention import (AttentionMetadata, PrefillChunk, build_decode_metadata, kv_cache_shape,
                                    paged_attention)
from mmkit.models.llama import Linear, LlamaModel

ROOT = Path(__file__).resolve().parents[2]
# CUDA-only: the marker alone (conftest skips `cuda` tests with a reason where there is no GPU).
CUDA = pytest.mark.cuda
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]


def _naive_attention(q, k, v, scale):
    # q: [Lq, H, D] attending causally to the LAST Lq of k, v: [Lk, Hkv, D]
    lq, h, d = q.shape
    lk, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1).float()
    v = v.repeat_interleave(h // hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(lq)[:, None] + (lk - lq)
    s = s.masked_fill(torch.arange(lk)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_naive(device, dtype):
    """Decodes of different lengths + a whole prompt + a chunk over a cached prefix, GQA."""
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, num_blocks = 4, 6, 2, 8, 64
    k_cache = torch.zeros(kv_cache_shape(num_blocks, bs, kv_heads, dim), dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    # Sequence lengths already in the cache (decodes: 3 sequences; chunk: cached prefix of 5).
    decode_lens, chunk_cached, chunk_new, prompt_len = [7, 1, 12], 5, 3, 6
    tables = [[10 + 4 * i + j for j in range(4)] for i in range(5)]
    hist = {}
    for i, n in enumerate(decode_lens + [chunk_cached]):
        k = torch.randn(n, kv_heads, dim, dtype=dtype, device=device)
        v = torch.randn(n, kv_heads, dim, dtype=dtype, device=device)
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)], device=device)
        from mmkit.layers.attention import write_kv
        write_kv(k_cache, v_cache, k, v, slots)
        hist[i] = (k, v)
    lens_new = decode_lens  # each decode adds one token at position len
    n_tok = len(decode_lens) + prompt_len + chunk_new
    q = torch.randn(n_tok, heads, dim, dtype=dtype, device=device)
    k = torch.randn(n_tok, kv_heads, dim, dtype=dtype, device=device)
    v = torch.randn(n_tok, kv_heads, dim, dtype=dtype, device=device)
    slots = [tables[i][n // bs] * bs + n % bs for i, n in enumerate(lens_new)]
    slots += [tables[4 + 0][p // bs] * bs + p % bs for p in range(prompt_len)]  # whole prompt: table 4
    tables.append([40 + j for j in range(4)])  # the cached-prefix chunk's table is 5 (fresh)
    # Re-home the cached prefix: the chunk sequence uses table index 3 (written above).
    slots += [tables[3][p // bs] * bs + p % bs for p in range(chunk_cached, chunk_cached + chunk_new)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), prefills=[
        PrefillChunk(3, prompt_len, prompt_len, torch.tensor(tables[4], device=device)),
        PrefillChunk(3 + prompt_len, chunk_new, chunk_cached + chunk_new, torch.tensor(tables[3], device=device)),
    ])
    # decodes are sequences 0..2 of `hist`; sequence 3 of hist is the chunk's prefix
    build_decode_metadata(meta, tables[:3], [n + 1 for n in decode_lens], bs, torch.device(device))
    scale = 1 / math.sqrt(dim)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, n in enumerate(decode_lens):
        kk = torch.cat([hist[i][0], k[i:i + 1]])
        vv = torch.cat([hist[i][1], v[i:i + 1]])
        ref = _naive_attention(q[i:i + 1], kk, vv, scale)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=tol, rtol=tol)
    rows = slice(3, 3 + prompt_len)
    torch.testing.assert_close(out[rows].float(), _naive_attention(q[rows], k[rows], v[rows], scale),
                               atol=tol, rtol=tol)
    rows = slice(3 + prompt_len, n_tok)
    kk = torch.cat([hist[3][0], k[rows]])
    vv = torch.cat([hist[3][1], v[rows]])
    torch.testing.assert_close(out[rows].float(), _naive_attention(q[rows], kk, vv, scale), atol=tol, rtol=tol)


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_weights_match_unfused(device):
    torch.manual_seed(0)
    config = _tiny_llama_config()
    with torch.device(device):
        ref = LlamaModel(config, 64).eval()
    fused = LlamaModel(config, 64).to(device).eval()
    fused.load_state_dict(ref.state_dict())
    fused.fuse_weights()
    assert fused.layers[0].self_attn.qkv_proj is not None and not hasattr(fused.layers[0].self_attn, "q_proj")
    outs = []
    for model in (ref, fused):
        shape = kv_cache_shape(8, 4, 2, 8)
        caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in range(2)]
        n = 10
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device),
                                 prefills=[PrefillChunk(0, n, n, torch.arange(3, device=device))])
        x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1)).to(device)
        with torch.inference_mode():
            outs.append(model(x, torch.arange(n, device=device), caches, meta))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_bf16_linear_matches_f_linear():
    torch.manual_seed(0)
    lin = Linear(64, 96).to(torch.bfloat16)
    lin.pack()
    assert lin._packed is not None
    for m in (1, 5, 33):
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=2e-2, rtol=2e-2)
    # float32 packs only into mmkit's panels (tests/test_linear_kernels.py), never oneDNN's
    lin32 = Linear(64, 96)
    lin32.pack()
    assert lin32._packed is None or (lin32._panels and lin32._packed.dtype == torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "gqa_tied_ckpt"])
def test_bf16_engine_matches_hf_bf16(ckpt, device, request):
    """bfloat16 is the fast path (on CPU: the C kernels): greedy tokens equal transformers'
    own bfloat16 generate, whatever the batch position."""
    from mmkit import LLM

    path = request.getfixturevalue(ckpt)
    prompts = ["Write a haiku about the sea.", "the quick brown fox", "a photo of", "Tell me a long story"]
    llm = LLM(str(path), dtype="bfloat16", device=device)
    out = llm.generate(prompts + prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in out]
    assert got[0] == got[-1]  # batch position does not matter
    for prompt, tokens in zip(prompts, got):
        ref = hf_greedy(path, prompt=prompt, max_new_tokens=12, dtype=torch.bfloat16, ignore_eos=True)
        # CUDA's bf16 kernels round differently from transformers' CPU reference: first tokens there.
        assert (tokens if device == "cpu" else tokens[:2]) == (ref if device == "cpu" else ref[:2]), prompt


def _run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "roofline.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_roofline_cpu_dry_run():
    res = _run_script("--device", "cpu", "--tiny", "--batch-sizes", "1,3", "--steps", "2", "--context-len", "20",
                      "--threads", "1")
    assert res.returncode == 0, res.stderr
    assert "of roofline" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_roofline_exits_cleanly_without_gpu():
    res = _run_script()
    assert res.returncode == 0
    assert "no CUDA GPU" in res.stdout


@CUDA
def test_roofline_tiny_on_cuda():
    res = _run_script("--tiny", "--batch-sizes", "1,8", "--steps", "3", "--context-len", "40")
    assert res.returncode == 0, res.stderr
    assert "of roofline" in res.stdout
