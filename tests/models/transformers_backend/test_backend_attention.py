"""The backend's eager attention path (soft-capping, chunked attention) on a hand-built paged
step, against attention computed directly from the full K/V; and the query fix for Llama 4's
position-dependent temperature scaling."""

from __future__ import annotations

import types

import pytest
import torch

from mmkit.layers.attention import AttentionMetadata, PrefillChunk, build_decode_metadata
from mmkit.models.transformers_backend.attention import _masked_attention
from mmkit.models.transformers_backend.quirks import fix_position_dependent_query

BS, HEADS, KV_HEADS, D = 4, 4, 2, 8


def _reference(q, keys, values, q_pos, chunk, window, softcap, scale):
    """q [H, D] at position q_pos; keys/values [KV_HEADS, n, D] for positions 0..n-1."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, 0)
    v = values.repeat_interleave(HEADS // KV_HEADS, 0)
    pos = torch.arange(k.shape[1])
    allowed = pos <= q_pos
    if chunk:
        allowed &= pos // chunk == q_pos // chunk
    if window:
        allowed &= pos > q_pos - window
    s = torch.einsum("hd,hnd->hn", q, k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hn,hnd->hd", s, v)


@pytest.mark.parametrize("chunk, window, softcap", [(4, None, None), (None, None, 5.0), (4, None, 2.0),
                                                    (None, 3, 5.0), (8, 5, None)])
def test_masked_attention_matches_direct_attention(chunk, window, softcap):
    torch.manual_seed(0)
    k_cache = torch.zeros(KV_HEADS, 16, BS, D)
    v_cache = torch.zeros_like(k_cache)
    # Sequence A: 10 tokens cached in blocks [3, 0, 7, 2], a chunk of 3 new ones (positions 10-12);
    # sequence B: one decode token at position 6 (blocks [5, 9]).
    full = {name: (torch.randn(KV_HEADS, n, D), torch.randn(KV_HEADS, n, D)) for name, n in (("a", 13), ("b", 7))}
    tables = {"a": [3, 0, 7, 2], "b": [5, 9]}
    for name, cached in (("a", 10), ("b", 6)):
        keys, values = full[name]
        for p in range(cached):
            block, off = tables[name][p // BS], p % BS
            k_cache[:, block, off], v_cache[:, block, off] = keys[:, p], values[:, p]
    q = torch.randn(4, HEADS, D)  # rows: B's decode, then A's three
    k_new = torch.stack([full["b"][0][:, 6]] + [full["a"][0][:, p] for p in (10, 11, 12)])
    v_new = torch.stack([full["b"][1][:, 6]] + [full["a"][1][:, p] for p in (10, 11, 12)])
    slots = [tables["b"][6 // BS] * BS + 6 % BS] + [tables["a"][p // BS] * BS + p % BS for p in (10, 11, 12)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_size=BS,
                             prefills=[PrefillChunk(1, 3, 13, torch.tensor(tables["a"]))])
    build_decode_metadata(meta, [tables["b"]], [7], BS, torch.device("cpu"))
    scale = D ** -0.5
    out = _masked_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, window, chunk, softcap)
    want = [_reference(q[0], *full["b"], 6, chunk, window, softcap, scale)]
    want += [_reference(q[1 + i], *full["a"], 10 + i, chunk, window, softcap, scale) for i in range(3)]
    torch.testing.assert_close(out, torch.stack(want), rtol=1e-5, atol=1e-5)


def test_temperature_tuned_queries_are_rescaled_to_the_real_positions():
    module = types.SimpleNamespace(attn_temperature_tuning=True, use_rope=False, floor_scale=4, attn_scale=0.1)

    def scale(p):
        return torch.log1p(torch.floor((torch.as_tensor(p).float() + 1.0) / 4)) * 0.1 + 1.0

    torch.manual_seed(1)
    raw = torch.randn(1, 2, 3, 8)
    positions = torch.tensor([17, 1, 9])  # a decode at 17, a prefill chunk at 1..
    assumed = raw * scale(torch.arange(3)).view(1, 1, 3, 1)  # what the module computed
    fixed = fix_position_dependent_query(module, assumed, positions)
    torch.testing.assert_close(fixed, raw * scale(positions).view(1, 1, 3, 1))
    assert torch.equal(fixed[:, :, 1], assumed[:, :, 1])  # same scale either way: untouched
    rope_layer = types.SimpleNamespace(attn_temperature_tuning=True, use_rope=True)
    assert fix_position_dependent_query(rope_layer, assumed, positions) is assumed
