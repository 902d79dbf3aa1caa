"""Sliding-window attention on the paged cache: the C decode kernel and the torch path against
a dense reference, a Mistral-decoder LLaVA past its window against transformers, and KV blocks
freed when every layer slides."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import blocks_held_while_decoding, hf_greedy
from mmkit import LLM, SamplingParams
from mmkit.layers import cpu_kernels
from mmkit.layers.attention import AttentionMetadata, build_decode_metadata, decode_attention_torch, kv_cache_shape
from mmkit.testing import build_tiny_llava


def _dense_window_reference(q, k_cache, v_cache, tables, lens, window, scale):
    """Each sequence's whole context gathered densely, keys in (p - window, p] attended."""
    kv_heads, _, block_size, dim = k_cache.shape
    outs = []
    for s, (table, n) in enumerate(zip(tables, lens)):
        idx = torch.tensor(table)
        k = k_cache[:, idx].reshape(kv_heads, -1, dim)[:, :n].float()
        v = v_cache[:, idx].reshape(kv_heads, -1, dim)[:, :n].float()
        lo = max(0, n - window)
        qs = q[s].float().view(kv_heads, -1, dim)  # [kv_heads, group, dim]
        o = F.scaled_dot_product_attention(qs, k[:, lo:], v[:, lo:], scale=scale)
        outs.append(o.reshape(-1, dim))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (6, 3, 16)])
def test_sliding_decode_matches_dense_reference(dtype, atol, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(1)
    block_size, window = 16, 37
    lens = [1, 20, 37, 38, 100, 301]  # inside, at, one past and far past the window
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 2
    k_cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, dim), generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(order[at:at + n])
        at += n
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    ref = _dense_window_reference(q, k_cache, v_cache, tables, lens, window, scale)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long))
    build_decode_metadata(meta, [list(t) for t in tables], list(lens), block_size, torch.device("cpu"))
    view = meta.window_view(window)
    # Only blocks overlapping a window are listed: at most ceil(window / block) + 1 per sequence.
    assert view.max_blocks <= math.ceil(window / block_size) + 1
    torch_out = decode_attention_torch(q, k_cache, v_cache, meta, scale, sliding_window=window)
    torch.testing.assert_close(torch_out.float(), ref, rtol=0, atol=atol)
    if cpu_kernels.library() is not None:
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, view.block_ids, view.max_blocks,
                                                 view.context_lens, scale, view.context_starts)
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)
        torch.testing.assert_close(out.float(), torch_out.float(), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def mistral_window32(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("swa32"), text_type="mistral", sliding_window=32, seed=5,
                            max_position_embeddings=1024)


def _long_prompt(tokenizer, num_tokens):
    ids = tokenizer("the quick brown fox jumps over the lazy dog " * 40).input_ids
    return ids[:num_tokens]


def test_mistral_window_32_past_the_window_equals_transformers(mistral_window32):
    path = mistral_window32
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == 1024  # no cap at the window any more
    ids = _long_prompt(llm.get_tokenizer(), 200)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = hf_greedy(path, input_ids=ids, max_new_tokens=40, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref
    # Chunked prefill (chunks start mid-prompt, reading cached blocks through the window).
    chunked = LLM(str(path), dtype="float32", max_num_batched_tokens=24)
    assert chunked.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == ref
    # A prefix-cache hit: the second request starts at block 12 of the same prompt.
    again = chunked.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref
    assert chunked.get_metrics()["prefix_cache_hits"] >= 192


def test_all_sliding_model_holds_window_blocks_while_decoding(mistral_window32):
    path = mistral_window32
    block_size, window = 16, 32
    llm = LLM(str(path), dtype="float32", block_size=block_size, enable_prefix_caching=False)
    engine = llm.llm_engine
    ids = _long_prompt(llm.get_tokenizer(), 40)
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=500,
                                                                       ignore_eos=True))
    bound = math.ceil(window / block_size) + 1
    held_max, steps = blocks_held_while_decoding(llm)
    assert steps >= 500 and 0 < held_max <= bound


def test_prefill_mask_is_window_and_causal_or_span():
    """transformers' Gemma 3 sliding mask: AND(window, OR(causal, same image span)), for a
    chunk that starts mid-prompt (cached keys before it)."""
    from mmkit.layers.attention import PrefillChunk

    spans, window, bs = ((5, 12),), 4, 4
    chunk = PrefillChunk(0, 10, 14, torch.arange(4), spans)  # queries 4..13
    first = chunk.first_key(window, bs)
    got = chunk.mask(window, first, torch.device("cpu"))[0, 0]
    for qi, q in enumerate(range(4, 14)):
        for ki, k in enumerate(range(first, 14)):
            same = any(lo <= q < hi and lo <= k < hi for lo, hi in spans)
            assert bool(got[qi, ki]) == ((k <= q or same) and k > q - window), (q, k)
