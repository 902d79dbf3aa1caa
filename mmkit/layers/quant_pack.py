"""Weight-only quantization formulas and the integer layouts mmkit's kernels read.

Online quantization (`LLM(quantization="int8" | "int4")`), in float32:
- int8, per output row, symmetric: s = max|w_row| / 127 (1 for an all-zero row),
  q = clamp(round(w / s), -127, 127); w' = q * s.
- int4, groups of G consecutive input columns per row: lo = min(0, min w_g), hi = max(0, max w_g),
  s = (hi - lo) / 15 (1 where hi == lo), z = round(-lo / s), q = clamp(round(w / s) + z, 0, 15);
  w' = (q - z) * s. (torch.round rounds half to even.)
A `QuantizedWeight` holds the integers, float32 scales [N, G] and zero points [N, G]; int4 values
are two per byte in the kernel's nibble order (`pack_int4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """Integer weight of one linear layer: w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[...]."""

    bits: int  # 8 or 4
    qweight: torch.Tensor  # int8 [N, K] (bits 8), uint8 [N, K // 2] packed (bits 4)
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor | None  # int8 (bits 8) / uint8 (bits 4) [N, G]; None = 0
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales) + ((self.zeros,) if self.zeros is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)

    def int_values(self) -> torch.Tensor:
        """q as int16 [N, K] (unpacked)."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        return unpack_int4(self.qweight, self.in_features).to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w' [N, K], computed in float32 as (q - z) * s, then cast to `dtype`."""
        q = self.int_values().float()
        if self.zeros is not None:
            q = q.unflatten(1, (-1, self.group_size)) - self.zeros.float().unsqueeze(-1)
        else:
            q = q.unflatten(1, (-1, self.group_size))
        return (q * self.scales.unsqueeze(-1)).flatten(1).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in 0..15 (K a multiple of 32) -> uint8 [N, K // 2]: in each block of 32
    columns byte j holds column j (low nibble) and column j + 16 (high nibble)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    n = packed.shape[0]
    blocks = packed.reshape(n, in_features // 32, 16)
    return torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(n, in_features)


def can_pack_int4(in_features: int, group_size: int) -> bool:
    """The nibble layout needs whole 32-column blocks; groups may be any divisor of K (16-weight
    groups included: every int4 kernel finds a column's group as k // group_size)."""
    return in_features % 32 == 0 and in_features % group_size == 0


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Per output row, symmetric (see the module docstring)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)  # [N, 1]
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 127)
    q = torch.clamp(torch.round(w / s), -127, 127).to(torch.int8)
    return QuantizedWeight(8, q, s, None, w.shape[1], w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Groups of `group_size` input columns per row, asymmetric (see the module docstring)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"quantization_config: group_size {group_size} does not divide a decoder layer's "
                         f"{k} input features; expected a divisor of {k}")
    g = w.unflatten(1, (k // group_size, group_size))  # [N, G, gs]
    lo = torch.clamp(g.amin(dim=-1), max=0)
    hi = torch.clamp(g.amax(dim=-1), min=0)
    s = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 15)  # [N, G]
    z = torch.round(-lo / s)
    q = torch.clamp(torch.round(g / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15).flatten(1)
    return from_int_values(q, s, z, 4, group_size)


def from_int_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                    group_size: int) -> QuantizedWeight:
    """A QuantizedWeight from unpacked integer values q [N, K] (int4: 0..15 with zeros 0..15;
    int8: -128..127 with signed zeros), scales [N, G]."""
    k = q.shape[1]
    scales = scales.float().contiguous()
    if bits == 8:
        z = None if zeros is None or not bool((zeros != 0).any()) else zeros.to(torch.int8).contiguous()
        return QuantizedWeight(8, q.to(torch.int8).contiguous(), scales, z, group_size, k)
    if zeros is None:
        raise ValueError("int4 weights are stored unsigned: zeros are required")
    if not can_pack_int4(k, group_size):  # kept as one int8 per value (still integer)
        return QuantizedWeight(8, (q - 8).to(torch.int8), scales, (zeros - 8).to(torch.int8), group_size, k)
    return QuantizedWeight(4, pack_int4(q), scales, zeros.to(torch.uint8).contiguous(), group_size, k)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-wise concatenation (q/k/v and gate/up fusion): rows are independent in every scheme."""
    first = parts[0]
    if any(p.bits != first.bits or p.group_size != first.group_size or (p.zeros is None) != (first.zeros is None)
           for p in parts):
        raise ValueError("model: fused projections are quantized differently (bits, group size or zero points)")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(first.bits, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                           zeros, first.group_size, first.in_features)
