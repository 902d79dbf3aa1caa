"""Paged attention: K/V written through a slot mapping, read back through block tables.

Decode attention on CPU runs the C kernel of `cpu_kernels` (blocks read in place) when it
could be built; otherwise, and on CUDA, the torch path below. Tokens of one step are laid out with all
decode tokens first (one per sequence, attended in one batched SDPA call over the gathered
blocks) and then the prefill chunks (one SDPA call each, causal within the chunk).

Cache layout (per layer, K and V alike): `[num_kv_heads, num_blocks, block_size, head_dim]`,
heads first. Gathering the blocks of a batch is then one `index_select` that yields
`[num_kv_heads, num_seqs, max_len, head_dim]` without a transpose copy, and a decode batch is
attended as `num_kv_heads` independent problems whose "queries" are the `num_heads /
num_kv_heads` query heads sharing that KV head: grouped-query attention with no repeated K/V.

Attention variants, per layer (a family only declares them; see `mmkit/layers/sliding_window.py`):
- a sliding window of W tokens (`paged_attention(..., sliding_window=W)`): the query at
  position p attends keys in (p - W, p], as transformers' `sliding_window_overlay`; only the
  blocks that overlap some query's window are listed, so blocks entirely before it are never
  read (and, for a model whose layers all slide, the block manager frees them);
- bidirectional spans (`PrefillChunk.spans`, e.g. Gemma 3's image soft tokens): a query
  inside a span also attends every key of the same span (transformers' `blockwise_overlay`,
  OR-ed with the causal mask; the window is AND-ed on top, so it clips backwards only). The
  scheduler computes a span in one chunk, so its later keys are always in the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mmkit import envs
from mmkit.layers import cpu_kernels

# `MMKIT_PAGED_PREFILL=0` keeps one SDPA call per prefill chunk on CPU (A/B measurements).
_PAGED_PREFILL = envs.MMKIT_PAGED_PREFILL
# Chunks with longer contexts keep SDPA: the kernel's per-thread scratch (the tile's context
# in float32, three copies) grows with the context. Up to here it was measured ahead of SDPA:
# 0.26-0.48x its time from 64 to 8192 keys, 2 threads, bf16 and float32
# (benchmarks/prefill_attention.py; benchmarks/results/round4/h/prefill_attention.log).
PAGED_PREFILL_MAX_CONTEXT = 8192
# Builds without AVX-512 (AVX2 CPUs: csrc/paged_tile_avx2.h) run the tiles at about half the
# FMA rate, and their 512 KB-1 MB L2 holds less of a tile's gathered K and V (8 bytes a key per
# head dimension in float32): measured 0.38-0.81x SDPA's time while that context is at most
# 2 MiB (4096 keys at head_dim 64, 2048 at 128), level with it at 4 MiB (8192 x 64) and 1.18x
# at 4 MiB (4096 x 128) (Zen 3, 2 threads; benchmarks/results/round4/n/tile_ab.log). So there
# a chunk's keys times head_dim is capped instead.
PAGED_PREFILL_MAX_KEYS_X_DIM_AVX2 = 4096 * 64


def paged_prefill_max_context(head_dim: int) -> int:
    """The longest context a prefill chunk may have to run on the paged rows kernel."""
    if cpu_kernels.has_avx512():
        return PAGED_PREFILL_MAX_CONTEXT
    return min(PAGED_PREFILL_MAX_CONTEXT, PAGED_PREFILL_MAX_KEYS_X_DIM_AVX2 // head_dim)


# Tokens of a chunk that share one read of their context from the cache (rows of one kernel
# work item): long enough that the read is a small part of the item, short enough that a
# chunk still splits into work for every thread.
PREFILL_TILE = 64


@dataclass
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the step's flat token batch
    query_len: int
    context_len: int  # tokens attended by the chunk's last query (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    # Bidirectional spans (absolute positions [start, end)) that overlap the chunk's queries.
    spans: tuple[tuple[int, int], ...] = ()
    # Boolean masks [query_len, keys] by window (0: none), built at first use in the step.
    _masks: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def is_whole_prompt(self) -> bool:
        return self.context_len == self.query_len

    def first_key(self, sliding_window: int | None, block_size: int) -> int:
        """First key position the chunk reads: block-aligned start of its first query's window."""
        if not sliding_window:
            return 0
        first = max(0, self.context_len - self.query_len - sliding_window + 1)
        return first // block_size * block_size

    def mask(self, sliding_window: int | None, first_key: int, device: torch.device) -> torch.Tensor:
        """[1, 1, query_len, context_len - first_key] bool: True = attend."""
        key = sliding_window or 0
        if key not in self._masks:
            q_pos = torch.arange(self.query_len, device=device)[:, None] + (self.context_len - self.query_len)
            k_pos = torch.arange(first_key, self.context_len, device=device)[None, :]
            allowed = k_pos <= q_pos
            if self.spans:
                q_span, k_span = _span_ids(q_pos[:, 0], self.spans), _span_ids(k_pos[0], self.spans)
                allowed |= (q_span[:, None] == k_span[None, :]) & (q_span[:, None] >= 0)
            if sliding_window:
                allowed &= k_pos > q_pos - sliding_window
            self._masks[key] = (first_key, allowed[None, None])
        return self._masks[key][1]


def _span_ids(positions: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Index of the span holding each position, -1 outside every span."""
    ids = torch.full(positions.shape, -1, dtype=torch.long, device=positions.device)
    for i, (lo, hi) in enumerate(spans):
        ids[(positions >= lo) & (positions < hi)] = i
    return ids


@dataclass
class DecodeView:
    """The decode batch as one layer kind reads it: each sequence's listed blocks (padded to
    the widest with block 0), the rows attended in them [start, len), the torch path's mask."""

    block_ids: torch.Tensor  # [num_decodes * max_blocks] int64
    max_blocks: int
    context_lens: torch.Tensor  # [num_decodes] rows of the listed blocks up to the new token
    context_starts: torch.Tensor | None  # [num_decodes] first attended row; None: all 0
    needs_mask: bool
    # Additive mask of the torch path, [1, num_decodes, 1, max_blocks * block_size] (0 = attend,
    # -inf = padding or out of the window): built at first use in a step and shared by the
    # layers; the CPU kernel reads exact rows and never builds it.
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step attention state; built by the ModelRunner and passed down explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    num_decode_tokens: int = 0
    # [num_decodes * max_blocks] int64: each decode's block table padded to the longest
    # live one (only the live blocks of the batch are read), flattened row-major.
    decode_block_ids: torch.Tensor | None = None
    decode_max_blocks: int = 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_needs_mask: bool = False  # some decode is shorter than the padded width
    prefills: list[PrefillChunk] = field(default_factory=list)
    block_size: int = 0
    # The decode batch as Python lists (block tables may hold -1 where a block out of every
    # window was freed), for the per-window views built at a sliding layer's first use.
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    decode_windows: dict[int, DecodeView] = field(default_factory=dict)
    # Another backend's attention for this step (`attention_backend.attach_backend`): called as
    # attend(q, k_cache, v_cache, scale, sliding_window) after the step's K/V are written.
    attend: object = None
    # Every row of the step (decodes, then each prefill token) as one row of the paged kernel,
    # built at a global layer's first use in a step: [view] or [None] when it cannot serve.
    _rows_view: list = field(default_factory=list, repr=False)
    # A hybrid decoder's state rows of the step (mmkit/worker/state_cache.py `StateBatch`), else None.
    state_batch: Any = None

    def window_view(self, sliding_window: int) -> DecodeView:
        """Decode view of a sliding layer: only the blocks overlapping each window."""
        view = self.decode_windows.get(sliding_window)
        if view is None:
            view = self.decode_windows[sliding_window] = _window_view(
                self.decode_tables, self.decode_lens, sliding_window, self.block_size, self.slot_mapping.device)
        return view


def _window_view(tables: list[list[int]], lens: list[int], window: int, block_size: int,
                 device: torch.device) -> DecodeView:
    firsts = [max(0, n - window) // block_size for n in lens]  # first listed block per sequence
    counts = [-(-n // block_size) - f for n, f in zip(lens, firsts)]
    width = max(counts)
    flat: list[int] = []
    rel_lens, starts = [], []
    for table, n, first, count in zip(tables, lens, firsts, counts):
        flat.extend(table[first:first + count])
        flat.extend([0] * (width - count))  # block 0 as filler; masked
        rel_lens.append(n - first * block_size)
        starts.append(max(0, n - window) - first * block_size)
    needs_mask = max(starts) > 0 or min(rel_lens) < width * block_size
    return DecodeView(_long_tensor(flat, device), width, _long_tensor(rel_lens, device),
                      _long_tensor(starts, device) if max(starts) > 0 else None, needs_mask)


def build_decode_metadata(meta: AttentionMetadata, block_tables: list[list[int]], context_lens: list[int],
                          block_size: int, device: torch.device, block_ids: torch.Tensor | None = None) -> None:
    """Fill the decode fields of `meta` for one decode token per sequence.

    `block_tables[i]` holds sequence i's blocks; `context_lens[i]` counts its tokens including
    the new one. Only live blocks are listed (padded to the longest with block 0).
    `block_ids`: those lists already flattened, [num_decodes * max live blocks] int64 on the
    CPU (the runner gathers them from its persistent tables, `worker/block_table.py`); without
    it they are flattened here, O(every block of the batch) in Python.
    """
    live = [-(-n // block_size) for n in context_lens]
    width = max(live)
    if block_ids is None:
        flat: list[int] = []
        for table, n in zip(block_tables, live):
            flat.extend(table[:n])
            flat.extend([0] * (width - n))  # block 0 as filler; masked below
        block_ids = torch.tensor(flat, dtype=torch.long)
    meta.num_decode_tokens = len(block_tables)
    meta.decode_block_ids = _to_device(block_ids, device)
    meta.decode_max_blocks = width
    meta.decode_context_lens = _long_tensor(context_lens, device)
    meta.decode_needs_mask = min(context_lens) < width * block_size
    meta.block_size = block_size
    meta.decode_tables = block_tables
    meta.decode_lens = context_lens
    meta.decode_windows = {}


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=torch.long), device)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [kv_heads, num_blocks, block_size, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
    if k.is_cpu and cpu_kernels.write_kv(k_cache, v_cache, k, v, slot_mapping):
        return
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """`block_ids`: [num_seqs * max_blocks] -> [kv_heads, num_seqs, max_blocks * block_size, head_dim]."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    blocks = cache.view(kv_heads, num_blocks, block_size * head_dim).index_select(1, block_ids)
    return blocks.view(kv_heads, num_seqs, -1, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    `sliding_window`: this layer's window in tokens (None: global attention).

    Returns [num_tokens, num_heads, head_dim].
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.attend is not None:
        return meta.attend(q, k_cache, v_cache, scale, sliding_window)
    nd = meta.num_decode_tokens
    if (meta.prefills and sliding_window is None and q.is_cpu and cpu_kernels.supports(q, k_cache)
            and _PAGED_PREFILL):
        # The new K/V are in the cache now, so a prefill token at position p is a decode row
        # whose context is [0, p]: one kernel call for the whole step instead of an SDPA call
        # (about 1 ms of fixed cost each on CPU, whatever the chunk's length) per chunk.
        rows = _rows_view(meta, q.shape[0], k_cache)
        if rows is not None:
            view, tiles = rows
            out = cpu_kernels.paged_rows_attention(q, k_cache, v_cache, view.block_ids, view.max_blocks,
                                                   view.context_lens, tiles, scale)
            if out is not None:
                return out
    view = _decode_view(meta, sliding_window) if nd else None
    if nd and not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, view, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, view, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, sliding_window)
    return out


def _rows_view(meta: AttentionMetadata, num_tokens: int,
               k_cache: torch.Tensor) -> tuple[DecodeView, torch.Tensor] | None:
    """The step's rows as decode rows of a global layer, with their tiles for
    `cpu_kernels.paged_rows_attention` (each decode alone, each chunk in runs of
    PREFILL_TILE tokens), or None when some chunk has bidirectional spans (its queries see
    later keys) or a context past `paged_prefill_max_context(head_dim)`, or the rows are not
    laid out as decodes first, then the chunks in order. `k_cache` (any layer's) gives the
    block size and head_dim."""
    if meta._rows_view:
        return meta._rows_view[0]
    _, _, block_size, head_dim = k_cache.shape
    view = None
    chunks = meta.prefills
    nd = meta.num_decode_tokens
    starts = [nd]
    for c in chunks:
        starts.append(starts[-1] + c.query_len)
    max_context = paged_prefill_max_context(head_dim)
    if (not any(c.spans or c.context_len > max_context for c in chunks) and starts[-1] == num_tokens
            and all(c.query_start == s for c, s in zip(chunks, starts))):
        live = [-(-c.context_len // block_size) for c in chunks]
        width = max(live + [meta.decode_max_blocks if nd else 0])
        ids, lens = [], []
        if nd:
            table = meta.decode_block_ids.view(nd, meta.decode_max_blocks)
            ids.append(F.pad(table, (0, width - meta.decode_max_blocks)))
            lens.append(meta.decode_context_lens)
        for c, n in zip(chunks, live):
            ids.append(F.pad(c.block_table[:n], (0, width - n)).expand(c.query_len, width))
            lens.append(torch.arange(c.context_len - c.query_len + 1, c.context_len + 1, device=c.block_table.device))
        tiles = list(range(nd))
        for c in chunks:
            tiles.extend(range(c.query_start, c.query_start + c.query_len, PREFILL_TILE))
        tiles.append(num_tokens)
        view = (DecodeView(torch.cat(ids).reshape(-1), width, torch.cat(lens), None, True),
                torch.tensor(tiles, dtype=torch.long))
    meta._rows_view.append(view)
    return view


def _decode_view(meta: AttentionMetadata, sliding_window: int | None) -> DecodeView:
    if sliding_window and max(meta.decode_lens) > sliding_window:
        return meta.window_view(sliding_window)
    # Every context fits in the window (or a global layer): the full view, built once per step.
    view = meta.decode_windows.get(0)
    if view is None:
        view = meta.decode_windows[0] = DecodeView(meta.decode_block_ids, meta.decode_max_blocks,
                                                   meta.decode_context_lens, None, meta.decode_needs_mask)
    return view


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      view: DecodeView, scale: float) -> torch.Tensor:
    if q.is_cpu:
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, view.block_ids, view.max_blocks,
                                                 view.context_lens, scale, view.context_starts)
        if out is not None:
            return out
    return decode_view_attention_torch(q, k_cache, v_cache, view, scale)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The reference decode path: gather the live blocks, then one batched SDPA call."""
    if sliding_window is None and not meta.decode_lens:  # metadata built by hand (tests)
        view = DecodeView(meta.decode_block_ids, meta.decode_max_blocks, meta.decode_context_lens, None,
                          meta.decode_needs_mask)
    else:
        view = _decode_view(meta, sliding_window)
    return decode_view_attention_torch(q, k_cache, v_cache, view, scale)


def decode_view_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                view: DecodeView, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    kd = gather_blocks(k_cache, view.block_ids, num_seqs)  # [kv_heads, seqs, T, head_dim]
    vd = gather_blocks(v_cache, view.block_ids, num_seqs)
    # Heads h = j * group + i share KV head j (transformers' repeat_kv order).
    qd = q.view(num_seqs, kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, seqs, group, head_dim]
    mask = _view_mask(view, kd.shape[2], q.dtype)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return od.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _view_mask(view: DecodeView, max_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    if view.needs_mask and view.mask is None:
        lens = view.context_lens
        rows = torch.arange(max_len, device=lens.device)[None, :]
        masked = rows >= lens[:, None]  # [num_decodes, max_len]
        if view.context_starts is not None:
            masked |= rows < view.context_starts[:, None]
        mask = torch.zeros(masked.shape, dtype=dtype, device=lens.device).masked_fill_(masked, float("-inf"))
        view.mask = mask[None, :, None, :]  # [1, num_decodes, 1, max_len]
    return view.mask


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                       sliding_window: int | None) -> torch.Tensor:
    qp = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    window = sliding_window if sliding_window and sliding_window < chunk.context_len else None
    if chunk.is_whole_prompt:
        # Nothing cached before this chunk: attend to the fresh K/V directly.
        kp = k.transpose(0, 1).unsqueeze(0)
        vp = v.transpose(0, 1).unsqueeze(0)
        if window is None and not chunk.spans:
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
        mask = chunk.mask(window, 0, q.device)
    else:
        ctx = chunk.context_len
        bs = k_cache.shape[2]
        first = chunk.first_key(window, bs)  # blocks before the first query's window: not read
        table = chunk.block_table[first // bs:-(-ctx // bs)]
        kp = gather_blocks(k_cache, table, 1).transpose(0, 1)[:, :, :ctx - first]
        vp = gather_blocks(v_cache, table, 1).transpose(0, 1)[:, :, :ctx - first]
        mask = chunk.mask(window, first, q.device)  # [1, 1, query_len, ctx - first]
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    return op[0].transpose(0, 1)
