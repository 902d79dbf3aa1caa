"""int8 / int4 weights in the bf16 panels' order, for the quantized panel GEMM
(csrc/quant_panels_cpu.c): a bf16 model's quantized decoder linears on CPUs with AVX512-BF16.

Layouts (P = ceil(N / 32) panels, Kp = K / 2 column pairs, G = K / group_size; zero past N):

    int8:   q[p, kp, 2 c + e] = q[32 p + c, 2 kp + e]                      int8  [P, Kp, 64]
    int4:   the same 64 values per (p, kp), byte j = value j | value 32 + j << 4  uint8 [P, Kp, 32]
    scales: s[p, g, c] = s[32 p + c, g]                                    float32 [P, G, 32]
    zeros:  z[p, g, c] = z[32 p + c, g] (int8 for int8, uint8 for int4) or None

The row-major `QuantizedWeight` is dropped once packed (`QuantizedLinear.pack`): the panels are
the only copy, with the same bytes per weight, so `weight_nbytes` and the RSS stay as low.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmkit.layers import cpu_kernels, linear_panels
from mmkit.layers.quant_pack import QuantizedWeight, from_int_values

PANEL = 32
# Rows up to which the kernel decodes the integers in registers (decode at small batch); above,
# each panel is decoded once per call into bf16 and the bf16 panel GEMM runs on it (measured
# crossover on the benchmark model's shapes, 2 threads: equal at 8 rows; benchmarks/README.md, "Round 4d").
DIRECT_MAX_ROWS = 8


@dataclass
class QuantPanels:
    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int

    def nbytes(self) -> int:
        tensors = (self.q, self.scales) + ((self.zeros,) if self.zeros is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)


def can_pack(w: QuantizedWeight, dtype: torch.dtype) -> bool:
    """bf16 activations on CPU, even K and group size (column pairs never straddle a group)."""
    return (dtype == torch.bfloat16 and w.qweight.device.type == "cpu" and w.bits in (8, 4)
            and w.in_features % 2 == 0 and w.group_size % 2 == 0 and w.in_features % w.group_size == 0
            and available())


def available() -> bool:
    """The dense panels are on and this build has their quantized twin (AVX512-BF16 only)."""
    return linear_panels.available() and bool(cpu_kernels.library().mmkit_quant_panel_gemm_available())


def _by_panel(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, G] per-row values -> [P, G, 32] (zero rows past N)."""
    padded = torch.zeros((rows, t.shape[1]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded.view(rows // PANEL, PANEL, -1).transpose(1, 2).contiguous()


def pack(w: QuantizedWeight) -> QuantPanels:
    n, k = w.out_features, w.in_features
    rows = -(-n // PANEL) * PANEL
    values = torch.zeros((rows, k), dtype=torch.int16)
    values[:n] = w.int_values()
    # [P, 32, Kp, 2] -> [P, Kp, 32, 2] -> 64 values per (panel, column pair), element 2 c + e
    pairs = values.view(rows // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).reshape(rows // PANEL, k // 2, 64)
    if w.bits == 8:
        q = pairs.to(torch.int8).contiguous()
    else:
        q = (pairs[..., :32] | (pairs[..., 32:] << 4)).to(torch.uint8).contiguous()
    zeros = None if w.zeros is None else _by_panel(w.zeros, rows)
    return QuantPanels(w.bits, q, _by_panel(w.scales, rows), zeros, w.group_size, k, n)


def unpack(p: QuantPanels) -> QuantizedWeight:
    """The row-major QuantizedWeight back (tests; a call the panel kernel does not take)."""
    n, k = p.out_features, p.in_features
    if p.bits == 8:
        pairs = p.q.to(torch.int16)
    else:
        b = p.q.to(torch.int16)
        pairs = torch.cat([b & 15, b >> 4], dim=-1)
    values = pairs.view(p.q.shape[0], k // 2, PANEL, 2).permute(0, 2, 1, 3).reshape(-1, k)[:n]
    scales = p.scales.transpose(1, 2).reshape(-1, p.scales.shape[1])[:n]
    zeros = None if p.zeros is None else p.zeros.transpose(1, 2).reshape(-1, p.zeros.shape[1])[:n]
    if p.bits == 4:
        return from_int_values(values, scales, zeros, 4, p.group_size)
    return QuantizedWeight(8, values.to(torch.int8).contiguous(), scales.contiguous(),
                           None if zeros is None else zeros.contiguous(), p.group_size, k)


def bind(p: QuantPanels, bias: torch.Tensor | None, direct_max_rows: int | None = None):
    """`run(x) -> x @ w'.T + bias` for bf16 x [M, K] on CPU with dense columns (rows may be
    strided; the caller checks). Pointers and sizes are looked up once (as linear_panels.bind);
    `run` holds `p` and `bias`, so the pointers stay valid while it lives (tensors must not be
    resized in place)."""
    kernel = cpu_kernels.library().mmkit_quant_panel_gemm
    linear_panels.bump_generation()
    k, n, bits, gs = p.in_features, p.out_features, p.bits, p.group_size
    q_ptr, s_ptr = p.q.data_ptr(), p.scales.data_ptr()
    z_ptr = p.zeros.data_ptr() if p.zeros is not None else None
    bias_ptr = bias.data_ptr() if bias is not None else None
    direct = DIRECT_MAX_ROWS if direct_max_rows is None else direct_max_rows
    empty, threads, bf16 = torch.empty, torch.get_num_threads, torch.bfloat16

    def run(x: torch.Tensor, _keep=(p, bias)) -> torch.Tensor:
        m = x.shape[0]
        out = empty((m, n), dtype=bf16)
        if m and kernel(out.data_ptr(), x.data_ptr(), x.stride(0), m, k, n, q_ptr, bits, s_ptr, z_ptr, gs,
                        bias_ptr, direct, threads()) != 0:
            raise MemoryError("mmkit: the quantized panel GEMM could not allocate its scratch memory")
        return out

    return run
