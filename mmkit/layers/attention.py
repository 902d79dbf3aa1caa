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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmkit.layers import cpu_kernels


@dataclass
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the step's flat token batch
    query_len: int
    context_len: int  # tokens attended by the chunk's last query (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64

    @property
    def is_whole_prompt(self) -> bool:
        return self.context_len == self.query_len


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
    # Additive mask of the torch decode path, [1, num_decodes, 1, max_blocks * block_size]
    # (0 = attend, -inf = padding): built on its first use in a step and shared by the layers;
    # the CPU kernel reads exact lengths and never builds it.
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_decode_metadata(meta: AttentionMetadata, block_tables: list[list[int]], context_lens: list[int],
                          block_size: int, device: torch.device) -> None:
    """Fill the decode fields of `meta` for one decode token per sequence.

    `block_tables[i]` holds sequence i's blocks; `context_lens[i]` counts its tokens including
    the new one. Only live blocks are listed (padded to the longest with block 0).
    """
    live = [-(-n // block_size) for n in context_lens]
    width = max(live)
    flat: list[int] = []
    for table, n in zip(block_tables, live):
        flat.extend(table[:n])
        flat.extend([0] * (width - n))  # block 0 as filler; masked below
    meta.num_decode_tokens = len(block_tables)
    meta.decode_block_ids = _long_tensor(flat, device)
    meta.decode_max_blocks = width
    meta.decode_context_lens = _long_tensor(context_lens, device)
    meta.decode_needs_mask = min(context_lens) < width * block_size


def _decode_mask(meta: AttentionMetadata, max_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    if meta.decode_needs_mask and meta.decode_mask is None:
        lens = meta.decode_context_lens
        masked = torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]  # [num_decodes, max_len]
        mask = torch.zeros(masked.shape, dtype=dtype, device=lens.device).masked_fill_(masked, float("-inf"))
        meta.decode_mask = mask[None, :, None, :]  # [1, num_decodes, 1, max_len]
    return meta.decode_mask


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [kv_heads, num_blocks, block_size, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
    if k.device.type == "cpu" and cpu_kernels.write_kv(k_cache, v_cache, k, v, slot_mapping):
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
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

    Returns [num_tokens, num_heads, head_dim].
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if nd and not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if q.device.type == "cpu":
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_ids,
                                                 meta.decode_max_blocks, meta.decode_context_lens, scale)
        if out is not None:
            return out
    return decode_attention_torch(q, k_cache, v_cache, meta, scale)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference decode path: gather the live blocks, then one batched SDPA call."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    kd = gather_blocks(k_cache, meta.decode_block_ids, num_seqs)  # [kv_heads, seqs, T, head_dim]
    vd = gather_blocks(v_cache, meta.decode_block_ids, num_seqs)
    # Heads h = j * group + i share KV head j (transformers' repeat_kv order).
    qd = q.view(num_seqs, kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, seqs, group, head_dim]
    mask = _decode_mask(meta, kd.shape[2], q.dtype)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return od.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    qp = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    if chunk.is_whole_prompt:
        # Nothing cached before this chunk: attend to the fresh K/V directly.
        kp = k.transpose(0, 1).unsqueeze(0)
        vp = v.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ctx = chunk.context_len
        kp = gather_blocks(k_cache, chunk.block_table, 1).transpose(0, 1)[:, :, :ctx]
        vp = gather_blocks(v_cache, chunk.block_table, 1).transpose(0, 1)[:, :, :ctx]
        offset = ctx - chunk.query_len
        q_pos = torch.arange(chunk.query_len, device=q.device)[:, None] + offset
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = (k_pos <= q_pos)[None, None]  # [1, 1, query_len, context_len]
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    return op[0].transpose(0, 1)
