"""mmkit's paged attention registered in transformers' `AttentionInterface` as "mmkit_paged".

transformers' attention modules project, normalize and rotate q/k/v themselves and then call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=...,
**kwargs)`. The backend sets its language model's implementation to "mmkit_paged", so that call
lands here with the step's tokens flattened into one batch row (decodes first, then prefill
chunks, as the ModelRunner lays them out): K/V are written into mmkit's paged cache and read back
through the step's block tables. No mask function is registered under the name, so
transformers builds no mask (its `_preprocess_mask_arguments` exits early): the masks are
computed here from mmkit's metadata.

What transformers computes per layer and how it is done here:
- causal, sliding window (`sliding_window` kwarg: keys in (p - W, p]), bidirectional spans
  (PrefillChunk.spans): `mmkit.layers.attention.paged_attention`, the native path's kernels;
- logit soft-capping (`softcap` kwarg) and chunked attention (a "chunked_attention" layer of
  `layer_types`: keys of the same `attention_chunk_size` chunk, up to p): `_masked_attention`,
  eager attention over the gathered blocks (as transformers' eager path computes it);
- layers without rotary are the module's own business (it simply does not rotate).

NOTE: the step's state reaches the function through a context variable set by the backend's
forward for the duration of the call (transformers' modules do not all forward unknown kwargs
to the attention function); the vision tower keeps its own implementation ("sdpa").
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mmkit.layers.attention import AttentionMetadata, gather_blocks, paged_attention, write_kv
from mmkit.models.transformers_backend.quirks import fix_position_dependent_query

ATTN_IMPLEMENTATION = "mmkit_paged"


@dataclass
class BackendStep:
    """One forward's attention state: the paged caches (one (K, V) per decoder layer), the
    step's metadata, and each layer's chunk size for chunked attention (None: not chunked)."""

    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    layer_chunk_sizes: Sequence[int | None] = ()
    positions: torch.Tensor | None = None  # [T] each row's position (the text row for 3-D rotary)
    # Each layer's window as transformers decides it from the config (mmkit/layers/sliding_window.py),
    # for modules that leave the window to the mask instead of passing `sliding_window`.
    layer_windows: Sequence[int | None] = ()


_STEP: contextvars.ContextVar[BackendStep | None] = contextvars.ContextVar("mmkit_backend_step", default=None)


def current_step() -> contextvars.ContextVar:
    return _STEP


def mmkit_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, num_heads, T, head_dim], key/value [1, num_kv_heads, T, head_dim] (rotated,
    not repeated) -> ([1, T, num_heads, head_dim], None), transformers' attention contract."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("mmkit_paged attention was called outside an mmkit engine step; the backend's "
                           "language model runs only inside TransformersBackendModel.forward")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"model: attention module {type(module).__name__} has no layer_idx; the transformers "
                           "backend needs it to find the layer's KV cache")
    if query.shape[0] != 1:
        raise RuntimeError(f"mmkit_paged attention expects the step flattened into one row; got batch {query.shape[0]}")
    k_cache, v_cache = step.kv_caches[layer]
    if step.positions is not None:
        query = fix_position_dependent_query(module, query, step.positions)
    q = query[0].transpose(0, 1).contiguous()  # [T, num_heads, head_dim]
    k = key[0].transpose(0, 1).contiguous().to(k_cache.dtype)  # [T, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1).contiguous().to(v_cache.dtype)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or (step.layer_windows[layer] if layer < len(step.layer_windows) else None)
    softcap = kwargs.get("softcap") or None
    chunk = step.layer_chunk_sizes[layer] if layer < len(step.layer_chunk_sizes) else None
    # The native kernels clip a bidirectional span by the window; transformers does not.
    windowed_spans = bool(window) and any(c.spans for c in step.meta.prefills)
    if softcap is None and chunk is None and not windowed_spans:
        out = paged_attention(q, k, v, k_cache, v_cache, step.meta, scale, sliding_window=window)
    else:
        out = _masked_attention(q, k, v, k_cache, v_cache, step.meta, scale, window, chunk, softcap)
    return out.unsqueeze(0), None


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                      chunk: int | None, softcap: float | None) -> torch.Tensor:
    """Eager attention per sequence over its gathered blocks, with soft-capping and chunked /
    sliding / span masks: q [T, H, D] -> [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    bs = k_cache.shape[2]
    device = q.device
    rows = [(i, 1, n, torch.tensor(t[:-(-n // bs)], dtype=torch.long, device=device), ())
            for i, (t, n) in enumerate(zip(meta.decode_tables, meta.decode_lens))]
    rows += [(c.query_start, c.query_len, c.context_len, c.block_table, c.spans) for c in meta.prefills]
    out = torch.empty_like(q)
    for start, num_q, ctx, table, spans in rows:
        first = 0  # first key read: blocks wholly outside every query's reach are skipped
        if window:
            first = max(first, ctx - num_q - window + 1)
        if chunk:
            first = max(first, (ctx - num_q) // chunk * chunk)
        if spans:
            first = min([first] + [lo for lo, hi in spans if lo < ctx])
        first = first // bs * bs
        blocks = table[first // bs:-(-ctx // bs)].to(device)
        kk = gather_blocks(k_cache, blocks, 1)[:, 0, :ctx - first]  # [kv_heads, keys, D]
        vv = gather_blocks(v_cache, blocks, 1)[:, 0, :ctx - first]
        q_pos = torch.arange(ctx - num_q, ctx, device=device)[:, None]
        k_pos = torch.arange(first, ctx, device=device)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        if chunk:
            allowed &= (k_pos // chunk) == (q_pos // chunk)
        # NOTE: transformers ORs the blockwise overlay onto the sliding / chunked causal mask,
        # so a span's queries see every key of their span, however far back.
        for lo, hi in spans:
            allowed |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
        qq = q[start:start + num_q].transpose(0, 1)  # [H, num_q, D]
        group = qq.shape[0] // kk.shape[0]
        kk = kk.repeat_interleave(group, dim=0)  # transformers' repeat_kv order
        vv = vv.repeat_interleave(group, dim=0)
        scores = torch.matmul(qq, kk.transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qq.dtype)
        out[start:start + num_q] = torch.matmul(probs, vv).transpose(0, 1)
    return out


def register() -> None:
    """Register "mmkit_paged" in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, mmkit_paged_attention)
