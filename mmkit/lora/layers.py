"""Projections that add every row's adapter delta: one grouped pass per layer over all rows.

A wrapped module keeps the base module and, per slot (`max_loras` of them), the adapter's A and
B: `a` [slots, num_slices * R, in], `b` [slots, R, out] (B transposed), `scales` [slots, num_slices]. A fused
projection (qkv, gate_up) has one slice per checkpoint projection: output columns of slice i
read ranks [i * R, (i + 1) * R), so q, k and v keep their own pairs without a block-diagonal B.

`LoRAContext` says which slot each row of the step runs under, as runs of consecutive rows
(the runner orders rows by adapter, as vLLM's punica kernels sort them): the delta of a run is
two matmuls, `(x[run] @ A^T) @ B^T * scale`, one run per adapter in the step.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRAContext:
    """The step's row -> slot mapping, shared by every wrapped module of a model."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []  # (first row, end row, slot), no slot-less rows
        self.row_slots: torch.Tensor | None = None  # [num_rows] int64, -1: the base model (C stack)
        self.num_rows = 0
        self.uniform: int | None = None  # one slot for every row of every call (a tower pass)

    def set_rows(self, slots: list[int]) -> None:
        """`slots[i]`: the slot of row i, -1 for the base model."""
        runs, start = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[start]:
                if slots[start] >= 0:
                    runs.append((start, i, slots[start]))
                start = i
        self.runs, self.num_rows = runs, len(slots)
        self.row_slots = torch.tensor(slots, dtype=torch.long) if runs else None

    def clear(self) -> None:
        self.runs, self.row_slots, self.num_rows, self.uniform = [], None, 0, None

    @property
    def active(self) -> bool:
        return bool(self.runs)


class LoRALinear(nn.Module):
    """`base(x)` plus each row's adapter delta. `slices`: output widths of the checkpoint
    projections fused in `base` (one entry for an unfused one)."""

    def __init__(self, base: nn.Module, slices: list[int], max_loras: int, max_rank: int,
                 ctx: LoRAContext, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.ctx = base, ctx
        self.in_features, self.out_features = base.in_features, base.out_features
        self.slices = list(slices)
        self.slice_starts = [sum(slices[:i]) for i in range(len(slices))]
        self.max_rank = max_rank
        n = len(slices)
        self.register_buffer("a", torch.zeros(max_loras, n * max_rank, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("scales", torch.zeros(max_loras, n, dtype=torch.float32), persistent=False)
        self.has_slot = [False] * max_loras  # slots holding weights for this module
        # [slots] int64 for the C decode stack: 1 where the slot holds weights (models/llama_decode_stack.py)
        self.register_buffer("slot_mask", torch.zeros(max_loras, dtype=torch.long), persistent=False)
        # Slice i is output columns [bounds[i], bounds[i + 1]) (int64 [n + 1], for the C stack).
        self.register_buffer("bounds", torch.tensor([0] + [sum(slices[:i + 1]) for i in range(n)], dtype=torch.long),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def lora_record(self, record_cls):
        """(record, tensors it points into) for the C decode stack (models/llama_decode_stack.py),
        or None where the buffers are not float32 CPU tensors."""
        tensors = (self.a, self.b, self.scales, self.slot_mask, self.bounds)
        if any(not t.is_cpu or not t.is_contiguous() for t in tensors) or self.a.dtype != torch.float32 \
                or self.b.dtype != torch.float32:
            return None
        rec = record_cls(*(t.data_ptr() for t in tensors), len(self.slices), self.max_rank)
        return rec, tensors

    def set_slot(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slice `index` of slot `slot` <- a [r, in], b [slice_out, r] (r <= max_rank)."""
        r = a.shape[0]
        lo, width = self.slice_starts[index], self.slices[index]
        if a.shape[1] != self.in_features or b.shape != (width, r):
            raise ValueError(f"shapes A {tuple(a.shape)} / B {tuple(b.shape)}; expected A [r, {self.in_features}] "
                             f"and B [{width}, r]")
        rows = slice(index * self.max_rank, index * self.max_rank + r)
        self.a[slot, rows] = a.to(self.a.dtype)
        self.b[slot, :r, lo:lo + width] = b.t().to(self.b.dtype)
        self.scales[slot, index] = scale
        self.has_slot[slot] = True
        self.slot_mask[slot] = 1

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot].zero_()
        self.has_slot[slot] = False
        self.slot_mask[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        ctx = self.ctx
        if ctx.uniform is not None:  # [..., in] under one adapter (the vision tower's shapes)
            if not self.has_slot[ctx.uniform]:
                return out
            flat = out.reshape(-1, self.out_features)
            self.add_delta(flat, x.reshape(-1, self.in_features), [(0, flat.shape[0], ctx.uniform)])
            return flat.view(out.shape)
        if not ctx.runs or x.dim() != 2 or x.shape[0] != ctx.num_rows:
            return out
        return self.add_delta(out, x, ctx.runs)

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, runs) -> torch.Tensor:
        """out [rows, out] += every run's delta (in place)."""
        R = self.max_rank
        for start, end, slot in runs:
            if not self.has_slot[slot]:
                continue
            xs = x[start:end].to(self.a.dtype)
            mid = xs @ self.a[slot].t()  # [rows, num_slices * R]
            for i, (lo, width) in enumerate(zip(self.slice_starts, self.slices)):
                scale = float(self.scales[slot, i])
                if scale == 0.0:
                    continue
                delta = (mid[:, i * R:(i + 1) * R] @ self.b[slot, :, lo:lo + width]) * scale
                if delta.dtype == out.dtype:
                    out[start:end, lo:lo + width] += delta
                else:  # float32 deltas on a bf16 output: one rounding, after the add (as the C stack)
                    view = out[start:end, lo:lo + width]
                    view.copy_((view.float() + delta).to(out.dtype))
        return out


class LoRAEmbedding(nn.Module):
    """The token embedding plus each row's adapter delta (PEFT's `lora_embedding_A/B`)."""

    def __init__(self, base: nn.Embedding, max_loras: int, max_rank: int, ctx: LoRAContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.ctx, self.max_rank = base, ctx, max_rank
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.register_buffer("a", torch.zeros(max_loras, self.num_embeddings, max_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(max_loras, self.embedding_dim, max_rank, dtype=dtype, device=device),
                             persistent=False)
        self.scales = [0.0] * max_loras
        self.has_slot = [False] * max_loras

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def set_slot(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """a [vocab, r] (lora_embedding_A transposed), b [hidden, r]."""
        r = a.shape[1]
        if a.shape[0] != self.num_embeddings or b.shape != (self.embedding_dim, r):
            raise ValueError(f"shapes A^T {tuple(a.shape)} / B {tuple(b.shape)}; expected [{self.num_embeddings}, r] "
                             f"and [{self.embedding_dim}, r] (a resized vocabulary is not supported)")
        self.a[slot, :, :r] = a.to(self.a.dtype)
        self.b[slot, :, :r] = b.to(self.b.dtype)
        self.scales[slot], self.has_slot[slot] = scale, True

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot], self.has_slot[slot] = 0.0, False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.base(ids)
        ctx = self.ctx
        if not ctx.runs or ids.dim() != 1 or ids.shape[0] != ctx.num_rows:
            return out
        for start, end, slot in ctx.runs:
            if self.has_slot[slot]:
                mid = self.a[slot][ids[start:end]]  # [rows, R]
                out[start:end] += ((mid @ self.b[slot].t()) * self.scales[slot]).to(out.dtype)
        return out
