"""Paged attention: K/V written through a slot mapping, read back through block tables.

This is the torch reference path (CPU and CUDA). Tokens of one step are laid out with all
decode tokens first (one per sequence, attended in one batched SDPA call over the gathered
blocks) and then the prefill chunks (one SDPA call each, causal within the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [num_seqs, max_blocks] -> [num_seqs, num_kv_heads, max_blocks * block_size, head_dim]
    blocks = cache[block_tables]  # [num_seqs, max_blocks, block_size, kv_heads, head_dim]
    num_seqs, max_blocks, block_size, kv_heads, head_dim = blocks.shape
    return blocks.view(num_seqs, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

    Returns [num_tokens, num_heads, head_dim].
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        qd = q[:nd].unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
        kd = _gather(k_cache, meta.decode_block_tables)
        vd = _gather(v_cache, meta.decode_block_tables)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=True)
        out[:nd] = od.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
        if chunk.is_whole_prompt:
            # Nothing cached before this chunk: attend to the fresh K/V directly.
            kp = k[rows].transpose(0, 1).unsqueeze(0)
            vp = v[rows].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=True)
        else:
            kp = _gather(k_cache, chunk.block_table[None])[:, :, : chunk.context_len]
            vp = _gather(v_cache, chunk.block_table[None])[:, :, : chunk.context_len]
            offset = chunk.context_len - chunk.query_len
            q_pos = torch.arange(chunk.query_len, device=q.device)[:, None] + offset
            k_pos = torch.arange(chunk.context_len, device=q.device)[None, :]
            mask = (k_pos <= q_pos)[None, None]  # [1, 1, query_len, context_len]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                                enable_gqa=True)
        out[rows] = op[0].transpose(0, 1)
    return out
