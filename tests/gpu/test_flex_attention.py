"""FlexAttention over the paged cache (mmkit/layers/flex_attention.py) against a reference that
gathers each sequence's logical K/V from its block table and attends with an explicit mask.

The CPU runs call flex_attention eagerly (the same mask_mod and score_mod the Triton kernel
reads); eager flex_attention ignores the block lists, so `_listed_only` re-runs it with the mask
AND-ed with "block listed in the BlockMask": the lists must cover every key a row attends."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmkit.layers.attention import AttentionMetadata, PrefillChunk, build_decode_metadata, paged_attention
from mmkit.layers.flex_attention import (FlexMetadata, build_flex_metadata, flex_paged_attention,
                                         physical_to_logical)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 16, 4, 48


def _cache(seed: int = 0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, NUM_BLOCKS, BS, D, generator=g, dtype=dtype).to(device)
    v = torch.randn(HKV, NUM_BLOCKS, BS, D, generator=g, dtype=dtype).to(device)
    return k, v


def _step(decode_lens, chunks, seed=1, device="cpu"):
    """Random disjoint block tables: `decode_lens` tokens each; `chunks`: (query_len,
    context_len, spans). Returns the metadata and [(table, first_q, last_q, spans)] per seq."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs, tables, used = [], [], 0
    for n in decode_lens:
        nb = -(-n // BS)
        tables.append(perm[used:used + nb])
        used += nb
        seqs.append((tables[-1], n - 1, n - 1, ()))
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long, device=device), block_size=BS)
    if decode_lens:
        build_decode_metadata(meta, tables, list(decode_lens), BS, torch.device(device))
    row = len(decode_lens)
    for query_len, ctx, spans in chunks:
        nb = -(-ctx // BS) + 1  # one spare block past the context, as a growing table has
        table = perm[used:used + nb]
        used += nb
        meta.prefills.append(PrefillChunk(row, query_len, ctx, torch.tensor(table, device=device), tuple(spans)))
        seqs.append((table[:-(-ctx // BS)], ctx - query_len, ctx - 1, tuple(spans)))
        row += query_len
    assert used <= NUM_BLOCKS
    return meta, seqs


def _reference(q, k_cache, v_cache, seqs, scale, window=None, softcap=None):
    """Per sequence: gather its logical keys, mask (causal | same span) & window, softmax."""
    out, row = [], 0
    for table, first_q, last_q, spans in seqs:
        n_q = last_q - first_q + 1
        idx = torch.tensor(table, device=q.device)
        keys = k_cache[:, idx].reshape(HKV, -1, D).float()  # [kv_heads, blocks * BS, D]
        vals = v_cache[:, idx].reshape(HKV, -1, D).float()
        q_pos = torch.arange(first_q, last_q + 1, device=q.device)[:, None]
        k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
        allowed = k_pos <= q_pos
        for lo, hi in spans:
            allowed |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
        allowed &= k_pos <= max(last_q, max((hi - 1 for _, hi in spans), default=0))
        if window:
            allowed &= k_pos > q_pos - window
        qs = q[row:row + n_q].float().view(n_q, HKV, H // HKV, D)
        scores = torch.einsum("qkgd,ktd->kgqt", qs, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("kgqt,ktd->qkgd", scores.softmax(-1), vals).reshape(n_q, H, D)
        out.append(o)
        row += n_q
    return torch.cat(out).to(q.dtype)


def _listed_only(fm: FlexMetadata, window):
    """Replace both BlockMasks' mask_mod by mask_mod AND (the key's block is listed)."""
    for kind in ("decode", "prefill"):
        if (kind == "decode" and not fm.num_decodes) or (kind == "prefill" and not fm.num_prefill_tokens):
            continue
        bm = fm.block_mask(kind, window)
        dense = bm.to_dense()[:, 0]  # [B, q_tiles, kv_blocks] 1 = listed
        inner, q_tile = bm.mask_mod, bm.BLOCK_SIZE[0]

        def mask(b, h, q_idx, kv_idx, inner=inner, dense=dense, q_tile=q_tile):
            return inner(b, h, q_idx, kv_idx) & (dense[b, q_idx // q_tile, kv_idx // BS] > 0)

        fm._masks[(kind, window or 0)] = type(bm).from_kv_blocks(
            bm.kv_num_blocks, bm.kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask, seq_lengths=bm.seq_lengths,
            compute_q_blocks=False)


CASES = {
    "decodes": ([5, 17, 1, 8], []),
    "whole_prompts": ([], [(9, 9, ()), (4, 4, ())]),
    "mixed": ([3, 12, 16], [(7, 7, ()), (5, 13, ())]),
    # Chunked prefill over a prefix-cache hit: 10 cached tokens, 6 new.
    "prefix_hit": ([9], [(6, 16, ()), (3, 21, ())]),
    "spans": ([4], [(10, 10, ((2, 7),)), (6, 14, ((9, 13),))]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_tile", [128, 4])
def test_flex_matches_reference_gather(case, window, q_tile):
    decode_lens, chunks = CASES[case]
    k_cache, v_cache = _cache()
    meta, seqs = _step(decode_lens, chunks)
    num_tokens = len(decode_lens) + sum(c[0] for c in chunks)
    q = torch.randn(num_tokens, H, D, generator=torch.Generator().manual_seed(2))
    fm = build_flex_metadata(meta, NUM_BLOCKS, q_tile=q_tile)
    _listed_only(fm, window)
    got = flex_paged_attention(q, k_cache, v_cache, fm, 0.3, sliding_window=window)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, seqs, 0.3, window), atol=1e-5, rtol=1e-5)


def test_softcap_score_mod():
    k_cache, v_cache = _cache()
    meta, seqs = _step([6, 11], [(5, 9, ())])
    q = 4 * torch.randn(7, H, D, generator=torch.Generator().manual_seed(3))
    fm = build_flex_metadata(meta, NUM_BLOCKS)
    got = flex_paged_attention(q, k_cache, v_cache, fm, 0.5, softcap=2.0)
    ref = _reference(q, k_cache, v_cache, seqs, 0.5, softcap=2.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, _reference(q, k_cache, v_cache, seqs, 0.5), atol=1e-3)


def test_flex_equals_torch_paged_path_after_write():
    """The engine's call order: write the step's K/V, then attend; flex equals paged_attention."""
    k_cache, v_cache = _cache()
    meta, _ = _step([7, 14], [(6, 6, ()), (4, 10, ())])
    bs = BS
    slots = []
    for table, n in zip(meta.decode_tables, meta.decode_lens):
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
    for c in meta.prefills:
        slots.extend(int(c.block_table[p // bs]) * bs + p % bs for p in range(c.context_len - c.query_len, c.context_len))
    meta.slot_mapping = torch.tensor(slots)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(len(slots), n, D, generator=g) for n in (H, HKV, HKV))
    k2, v2 = k_cache.clone(), v_cache.clone()
    ref = paged_attention(q, k, v, k2, v2, meta, 0.25)
    fm = build_flex_metadata(meta, NUM_BLOCKS)
    got = flex_paged_attention(q, k2, v2, fm, 0.25)  # k2/v2 already hold the new rows
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_block_lists_are_exactly_the_live_blocks():
    meta, seqs = _step([17, 3], [(6, 16, ())])
    fm = build_flex_metadata(meta, NUM_BLOCKS)
    dec = fm.block_mask("decode", None)
    assert dec.kv_num_blocks.flatten().tolist() == [5, 1]
    assert dec.kv_indices[0, 0, 0, :5].tolist() == seqs[0][0]
    windowed = fm.block_mask("decode", 5)  # position 16 sees keys 12..16: blocks 3 and 4 only
    assert windowed.kv_indices[0, 0, 0, :windowed.kv_num_blocks[0, 0, 0]].tolist() == seqs[0][0][3:5]
    pre = fm.block_mask("prefill", 5)  # queries 10..15, window 5: keys from 6 -> blocks 1..3
    assert sorted(pre.kv_indices[0, 0, 0, :pre.kv_num_blocks[0, 0, 0]].tolist()) == sorted(seqs[2][0][1:4])


def test_physical_to_logical_skips_freed_blocks():
    p2l = physical_to_logical([torch.tensor([3, -1, 5]), torch.tensor([0])], 6, torch.device("cpu"))
    assert p2l.tolist() == [[-1, -1, -1, 0, -1, 2], [0, -1, -1, -1, -1, -1]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention's Triton kernel)")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_compiled_on_cuda_matches_reference(window):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from mmkit.layers.attention_backend import compiled_flex_attention

    k_cache, v_cache = _cache(device="cuda")
    meta, seqs = _step([3, 12, 16], [(7, 7, ()), (5, 13, ()), (10, 10, ((2, 7),))], device="cuda")
    q = torch.randn(len(seqs) + 19, H, D, device="cuda")[:3 + 22]
    fm = build_flex_metadata(meta, NUM_BLOCKS, q_tile=128)
    got = flex_paged_attention(q, k_cache, v_cache, fm, 0.3, sliding_window=window, attend=compiled_flex_attention())
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, seqs, 0.3, window), atol=2e-5, rtol=2e-5)


def test_chunks_sharing_prefix_blocks_in_one_tile():
    """Two chunks over the same cached prefix (prefix-cache hits share physical blocks) in one
    query tile: a shared block is listed once, each row still sees its own sequence's keys."""
    k_cache, v_cache = _cache(seed=5)
    shared = [7, 3]  # positions 0..7 of both sequences
    tables = [shared + [11, 20], shared + [15, 21]]
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=BS)
    meta.prefills = [PrefillChunk(0, 4, 12, torch.tensor(tables[0])), PrefillChunk(4, 6, 14, torch.tensor(tables[1]))]
    seqs = [(tables[0][:3], 8, 11, ()), (tables[1][:4], 8, 13, ())]
    q = torch.randn(10, H, D, generator=torch.Generator().manual_seed(6))
    fm = build_flex_metadata(meta, NUM_BLOCKS)
    pre = fm.block_mask("prefill", None)
    listed = pre.kv_indices[0, 0, 0, :pre.kv_num_blocks[0, 0, 0]].tolist()
    assert sorted(listed) == [3, 7, 11, 15, 21]
    _listed_only(fm, None)
    got = flex_paged_attention(q, k_cache, v_cache, fm, 0.3)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, seqs, 0.3), atol=1e-5, rtol=1e-5)
