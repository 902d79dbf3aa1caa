"""Paged attention on torch's FlexAttention, reading the paged KV cache in place.

FlexAttention compiles to a Triton kernel on CUDA (and to C++ on CPU under `torch.compile`);
called eagerly it runs torch's reference implementation of the same mask and score mods, so
the CPU tests run exactly the metadata and mods the CUDA kernel reads.

How the cache is read: the cache of one layer, `[num_kv_heads, num_blocks, block_size,
head_dim]` (mmkit's heads-first layout, `attention.kv_cache_shape`), is viewed without a copy
as one long "key sequence" `[1, num_kv_heads, num_blocks * block_size, head_dim]` of physical
slots. A `BlockMask` whose KV tile is one cache block lists, for every tile of query rows, the
physical blocks those rows read (`kv_indices`), so the kernel visits only live blocks; the
`mask_mod` maps a physical slot back to the row's logical key position through
`physical_to_logical[seq, block]` (-1 where the block is not the row's) and applies
causality, the sliding window and bidirectional spans there.

Two calls per layer and step, each with its own BlockMask (built once per step and window,
shared by the layers):
- decodes: query `[num_decodes, num_heads, 1, head_dim]`, one batch entry per sequence, the
  cache broadcast as batch 1 (FlexAttention allows Bkv=1 with a block mask of batch Bq);
- prefill chunks: every prefill token of the step as one flat query `[1, num_heads,
  num_prefill_tokens, head_dim]`; a query tile lists the union of the blocks its rows read
  (a tile straddling two chunks reads both chunks' blocks, masked per row).

Variants: a sliding window W (keys in (p - W, p]) clips the listed blocks and the mask; a
bidirectional span [lo, hi) lets its queries see every key of the span; soft-capping
(`cap * tanh(score / cap)`) is a `score_mod`. Anything else is refused by name
(`UnsupportedAttention`), never computed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mmkit.layers.attention import AttentionMetadata

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

# Query rows per tile of the prefill BlockMask (the Triton kernel's sparse block; 128 is
# FlexAttention's default).
PREFILL_Q_TILE = 128
# The decode BlockMask's query tile: one query row per batch entry, but the Triton kernels need a
# sparse Q block that their BLOCK_M (at least 16) divides, so the one row sits in a tile of 128.
DECODE_Q_TILE = 128


class UnsupportedAttention(ValueError):
    """An attention variant this backend does not compute; the message names it."""


def is_available() -> bool:
    return flex_attention is not None


@dataclass
class FlexRows:
    """Per-query-row tensors read by the mask_mod (one entry per row of one call)."""

    seq: torch.Tensor  # [rows] int32: row of `physical_to_logical`
    pos: torch.Tensor  # [rows] int32: the query's absolute position
    span_lo: torch.Tensor  # [rows] int32: the bidirectional span holding the query, [lo, hi)
    span_hi: torch.Tensor  # [rows] int32 (lo == hi == 0: none)


@dataclass
class FlexMetadata:
    """Everything both calls of a step need, built once per step by `build_flex_metadata`."""

    block_size: int
    num_blocks: int  # physical blocks in the cache
    num_decodes: int
    num_prefill_tokens: int
    physical_to_logical: torch.Tensor  # [num_seqs, num_blocks] int32, -1: not the seq's block
    # Per sequence of the step (decodes first, then chunks): its block table row and length.
    # Per prefill chunk (sequence nd + j): its live block table and its length after the step.
    tables: list[torch.Tensor]
    seq_lens: list[int]
    decode_rows: FlexRows | None
    prefill_rows: FlexRows | None
    # Per prefill tile: (first row, end row) and which sequences' rows it holds.
    prefill_tiles: list[tuple[int, int]] = field(default_factory=list)
    prefill_tile_seqs: list[list[int]] = field(default_factory=list)
    prefill_first_pos: list[int] = field(default_factory=list)  # per seq: first query position
    q_tile: int = PREFILL_Q_TILE
    decode_tables: torch.Tensor | None = None  # [num_decodes, width] padded block tables
    # Per prefill chunk: (first row among the prefill rows, query_len, bidirectional spans).
    prefill_chunks: list[tuple[int, int, tuple]] = field(default_factory=list)
    _masks: dict = field(default_factory=dict, repr=False)

    def block_mask(self, kind: str, sliding_window: int | None) -> "BlockMask":
        key = (kind, sliding_window or 0)
        if key not in self._masks:
            build = _decode_block_mask if kind == "decode" else _prefill_block_mask
            self._masks[key] = build(self, sliding_window or 0)
        return self._masks[key]


def build_flex_metadata(meta: AttentionMetadata, num_blocks: int, q_tile: int = PREFILL_Q_TILE) -> FlexMetadata:
    """The FlexAttention view of a step's `AttentionMetadata` (decodes first, then chunks)."""
    bs = meta.block_size
    device = meta.slot_mapping.device
    nd = meta.num_decode_tokens
    tables = [chunk.block_table[:-(-chunk.context_len // bs)].to(device) for chunk in meta.prefills]
    seq_lens = [chunk.context_len for chunk in meta.prefills]
    p2l = torch.full((nd + len(tables), num_blocks), -1, dtype=torch.int32, device=device)
    decode_rows = None
    if nd:
        # Decodes in whole-batch tensor ops (no per-sequence launches): [nd, width] tables.
        padded = meta.decode_block_ids.view(nd, meta.decode_max_blocks)
        lens = meta.decode_context_lens.to(device)
        _scatter_logical(p2l[:nd], padded, -(-lens // bs))
        seq = torch.arange(nd, dtype=torch.int32, device=device)
        zero = torch.zeros(nd, dtype=torch.int32, device=device)
        decode_rows = FlexRows(seq, (lens - 1).to(torch.int32), zero, zero)
    if tables:
        p2l[nd:] = physical_to_logical(tables, num_blocks, device)
    prefill_rows = None
    tiles, tile_seqs, first_pos = [], [], []
    num_prefill = sum(c.query_len for c in meta.prefills)
    if meta.prefills:
        seq_parts, pos_parts, lo_parts, hi_parts = [], [], [], []
        for j, chunk in enumerate(meta.prefills):
            first = chunk.context_len - chunk.query_len
            pos = torch.arange(first, chunk.context_len, dtype=torch.int32, device=device)
            lo = torch.zeros_like(pos)
            hi = torch.zeros_like(pos)
            for s_lo, s_hi in chunk.spans:
                inside = (pos >= s_lo) & (pos < s_hi)
                lo[inside] = s_lo
                hi[inside] = s_hi
            seq_parts.append(torch.full_like(pos, nd + j))
            pos_parts.append(pos)
            lo_parts.append(lo)
            hi_parts.append(hi)
        prefill_rows = FlexRows(torch.cat(seq_parts), torch.cat(pos_parts), torch.cat(lo_parts), torch.cat(hi_parts))
        # Which sequences have rows in each tile (a Python walk over chunks, not over rows).
        starts = [0]
        for c in meta.prefills:
            starts.append(starts[-1] + c.query_len)
        for t0 in range(0, num_prefill, q_tile):
            t1 = min(t0 + q_tile, num_prefill)
            tiles.append((t0, t1))
            tile_seqs.append([nd + j for j in range(len(meta.prefills)) if starts[j] < t1 and starts[j + 1] > t0])
        first_pos = [0] * nd + [c.context_len - c.query_len for c in meta.prefills]
    return FlexMetadata(bs, num_blocks, nd, num_prefill, p2l, tables, seq_lens, decode_rows, prefill_rows,
                        tiles, tile_seqs, first_pos, q_tile, padded if nd else None,
                        [(starts[j], c.query_len, c.spans) for j, c in enumerate(meta.prefills)] if meta.prefills else [])


def _scatter_logical(p2l: torch.Tensor, tables: torch.Tensor, live: torch.Tensor) -> None:
    """p2l[row, tables[row, j]] = j for the live columns j < live[row]; padding and freed (-1)
    entries may repeat a live block id, so they scatter -1 under a max (never over a live j)."""
    cols = torch.arange(tables.shape[1], device=tables.device)
    logical = torch.where((cols[None, :] < live[:, None]) & (tables >= 0), cols[None, :], -1).to(p2l.dtype)
    p2l.scatter_reduce_(1, tables.clamp(min=0).long(), logical, reduce="amax")


def decode_block_lists(tables: torch.Tensor, lens: torch.Tensor, block_size: int, window: int,
                       num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode BlockMask's (counts [nd] int32, indices [nd, num_blocks] int32) from the padded
    tables [nd, width] and lengths [nd], in whole-batch ops: each row's blocks from the first
    one its window reaches (0 without a window) to its last live one."""
    width = tables.shape[1]
    live = -(-lens // block_size)
    first = torch.clamp(lens - window, min=0) // block_size if window else torch.zeros_like(lens)
    cols = torch.arange(width, device=tables.device)
    idx = torch.clamp(first[:, None] + cols[None, :], max=width - 1)
    kv_idx = torch.zeros(tables.shape[0], max(num_blocks, width), dtype=torch.int32, device=tables.device)
    kv_idx[:, :width] = tables.gather(1, idx).clamp(min=0)
    return (live - first).to(torch.int32), kv_idx[:, :num_blocks]


def physical_to_logical(tables: list[torch.Tensor], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[num_seqs, num_blocks] int32: the logical index of each physical block in each table,
    -1 elsewhere (and for -1 entries: blocks freed out of every window)."""
    p2l = torch.full((max(len(tables), 1), num_blocks), -1, dtype=torch.int32, device=device)
    for s, table in enumerate(tables):
        table = table.to(device=device, dtype=torch.long)
        logical = torch.arange(table.numel(), dtype=torch.int32, device=device)
        live = table >= 0
        p2l[s].index_copy_(0, table[live], logical[live])
    return p2l


def _mask_mod(fm: FlexMetadata, rows: FlexRows, window: int, row_of: Callable) -> Callable:
    p2l, bs = fm.physical_to_logical, fm.block_size

    def mask(b, h, q_idx, kv_idx):
        row = row_of(b, q_idx)
        logical = p2l[rows.seq[row], kv_idx // bs]
        k_pos = logical * bs + kv_idx % bs
        q_pos = rows.pos[row]
        seen = (k_pos <= q_pos) | ((k_pos >= rows.span_lo[row]) & (k_pos < rows.span_hi[row]))
        allowed = (logical >= 0) & seen
        if window:
            allowed = allowed & (k_pos > q_pos - window)
        return allowed

    return mask


def _live_range(fm: FlexMetadata, seq: int, first_q: int, last_q: int, window: int) -> tuple[int, int]:
    """Logical blocks [lo, hi) that queries at positions [first_q, last_q] of `seq` read."""
    bs = fm.block_size
    lo = max(0, first_q - window + 1) // bs if window else 0
    return lo, -(-(last_q + 1) // bs)


def _decode_block_mask(fm: FlexMetadata, window: int) -> "BlockMask":
    kv_num, kv_idx = decode_block_lists(fm.decode_tables, (fm.decode_rows.pos + 1).long(), fm.block_size, window,
                                        fm.num_blocks)
    return BlockMask.from_kv_blocks(kv_num[:, None, None], kv_idx[:, None, None, :],
                                    BLOCK_SIZE=(DECODE_Q_TILE, fm.block_size),
                                    mask_mod=_mask_mod(fm, fm.decode_rows, window, lambda b, q: b),
                                    seq_lengths=(1, fm.num_blocks * fm.block_size), compute_q_blocks=False)


def _prefill_block_mask(fm: FlexMetadata, window: int) -> "BlockMask":
    rows = fm.prefill_rows
    lists = []
    for (t0, t1), seqs in zip(fm.prefill_tiles, fm.prefill_tile_seqs):
        parts = []
        for s in seqs:
            # The tile's rows of chunk j, in host arithmetic (no device reads): its rows
            # [start, start + query_len) hold positions first_pos + (row - start).
            j = s - fm.num_decodes
            start, query_len, spans = fm.prefill_chunks[j]
            first = fm.prefill_first_pos[s]
            q_first = first + max(t0, start) - start
            q_last = first + min(t1, start + query_len) - 1 - start
            lo, hi = _live_range(fm, s, q_first, q_last, window)
            # A bidirectional span holding one of the tile's queries may reach past the last one.
            spans_hi = max((h for lo_s, h in spans if lo_s <= q_last and h > q_first), default=0)
            hi = max(hi, -(-spans_hi // fm.block_size))
            parts.append(fm.tables[j][lo:hi])
        blocks = torch.cat(parts).long()
        lists.append(torch.unique(blocks[blocks >= 0]))
    kv_num, kv_idx = _pack(lists, fm.num_blocks, rows.seq.device)
    return BlockMask.from_kv_blocks(kv_num[None, None], kv_idx[None, None], BLOCK_SIZE=(fm.q_tile, fm.block_size),
                                    mask_mod=_mask_mod(fm, rows, window, lambda b, q_idx: q_idx),
                                    seq_lengths=(fm.num_prefill_tokens, fm.num_blocks * fm.block_size),
                                    compute_q_blocks=False)


def _pack(lists: list[torch.Tensor], num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged block lists -> (counts [n] int32, indices [n, num_blocks] int32, padded with 0).
    NOTE: BlockMask's indices are as wide as the KV length in blocks (its dense form and
    transposes assume it); the kernel reads only the first `counts` of each row."""
    lists = [t[t >= 0].to(device=device, dtype=torch.int32) for t in lists]
    width = num_blocks
    idx = torch.zeros(len(lists), width, dtype=torch.int32, device=device)
    for i, t in enumerate(lists):
        idx[i, :t.numel()] = t
    return torch.tensor([t.numel() for t in lists], dtype=torch.int32, device=device), idx


def _softcap_mod(cap: float) -> Callable:
    def score(s, b, h, q_idx, kv_idx):
        return cap * torch.tanh(s / cap)

    return score


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fm: FlexMetadata,
                         scale: float, sliding_window: int | None = None, softcap: float | None = None,
                         attend: Callable | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (decodes first, then prefill tokens), the step's new
    K/V already written to the caches. Returns [num_tokens, num_heads, head_dim].
    `attend`: the flex_attention callable (the compiled one on CUDA; eager by default)."""
    if flex_attention is None:
        raise UnsupportedAttention("attention_backend: 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    attend = attend or flex_attention
    kv_heads, num_blocks, bs, head_dim = k_cache.shape
    k = k_cache.view(1, kv_heads, num_blocks * bs, head_dim)
    v = v_cache.view(1, kv_heads, num_blocks * bs, head_dim)
    score_mod = _softcap_mod(float(softcap)) if softcap else None
    out = torch.empty_like(q)
    nd = fm.num_decodes
    if nd:
        qd = q[:nd].unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
        od = attend(qd, k, v, score_mod=score_mod, block_mask=fm.block_mask("decode", sliding_window),
                    scale=scale, enable_gqa=True)
        out[:nd] = od[:, :, 0]
    if fm.num_prefill_tokens:
        qp = q[nd:].transpose(0, 1).unsqueeze(0)  # [1, num_heads, num_prefill_tokens, head_dim]
        op = attend(qp, k, v, score_mod=score_mod, block_mask=fm.block_mask("prefill", sliding_window),
                    scale=scale, enable_gqa=True)
        out[nd:] = op[0].transpose(0, 1)
    return out
