"""Linear layers whose weights stay quantized in memory: int8 / int4 weight-only and FP8.

`QuantizedLinear` keeps a `QuantizedWeight` (integers + float32 scales/zeros) and computes
x @ w'^T with w' = (q - z) * s:
- CPU, float32/bf16 activations, few rows (decode): the C GEMV kernel (`csrc/quant_gemm_cpu.c`)
  reads the integers directly: 1/2 (int8) or 1/4 (int4) of bf16's bytes.
- CPU, bf16, up to `TILED_MAX_ROWS` rows (batched decode, short prefills): the tiled kernel
  (`csrc/quant_gemm_tiled_cpu.c`) decodes each weight once per call into bf16 and runs a
  register-blocked VDPBF16PS GEMM on it.
- otherwise (prefill's large batches, CUDA, no compiler): the weight is dequantized for the call
  (float32 formula, then cast; on CPU one C pass, `csrc/quant_dequant_cpu.c`) and `F.linear`
  runs on it (dequantize-on-the-fly per layer: for a prefill of T rows the float GEMM's
  2 N K T flops dwarf the N K dequantized values).
`Fp8Linear` keeps float8_e4m3fn weights with per-row scales; with dynamic per-token activations
the input is first rounded as compressed-tensors does: s_x = max|x_row| / 448,
x' = e4m3(x / s_x) * s_x.

The quantized tensors are plain attributes, not parameters/buffers: `model.to(dtype)` must not
cast float32 scales or float8 weights to the engine dtype.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from mmkit import envs
from mmkit.layers import cpu_kernels, linear_panels, quant_panels
from mmkit.layers.quant_pack import QuantizedWeight, concat_rows

KERNEL_MAX_ROWS = 16  # float32: above this, a float GEMM on the dequantized weight is faster
# bf16 rows: the GEMV kernel up to this many (by bits; it decodes weights in registers, but
# once per 4 rows), then the tiled kernel (decodes once, 32 products per instruction) up to
# TILED_MAX_ROWS, then the dequantized weight in oneDNN (measured crossovers, 1 thread,
# SmolLM2-135M shapes: benchmarks/README.md, "Quantized weights").
GEMV_MAX_ROWS_BF16 = {8: 4, 4: 8}
TILED_MAX_ROWS = 512
_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_FP8_MAX = 448.0


def _kernel(name: str = "mmkit_quant_gemm"):
    """A kernel of csrc/quant_gemm_cpu.c / quant_dequant_cpu.c, or None (no compiler, disabled)."""
    lib = cpu_kernels.library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        if name in ("mmkit_quant_gemm", "mmkit_quant_gemm_tiled"):
            fn.argtypes = [p, p, i64, i64, i64, i, p, i, p, p, i64, i] if name == "mmkit_quant_gemm" else \
                [p, p, i64, i64, i64, p, i, p, p, i64, i]
            fn.restype = ctypes.c_int
        else:  # mmkit_quant_dequantize
            fn.argtypes, fn.restype = [p, i, p, i, p, p, i64, i64, i64, i], None
    return fn


def dequantize(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """w' [N, K] in `dtype`: the C kernel on CPU for float32/bf16 (one pass, all threads,
    bit-identical to `QuantizedWeight.dequantize`), else the torch formula."""
    fn = _kernel("mmkit_quant_dequantize") if w.qweight.device.type == "cpu" and dtype in _KERNEL_DTYPES else None
    # NOTE: the C pass walks packed int4 in whole 32-column blocks of one group each; smaller or
    # straddling groups (compressed-tensors' group size 16) take the torch formula.
    if fn is None or (w.bits == 4 and w.group_size % 32 != 0):
        return w.dequantize(dtype)
    out = torch.empty((w.out_features, w.in_features), dtype=dtype)
    zeros = w.zeros.data_ptr() if w.zeros is not None else None
    fn(out.data_ptr(), _KERNEL_DTYPES[dtype], w.qweight.data_ptr(), w.bits, w.scales.data_ptr(), zeros,
       w.out_features, w.in_features, w.group_size, torch.get_num_threads())
    return out


def quant_gemm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor | None:
    """x [M, K] (float32/bf16, CPU) @ w'^T -> [M, N] in x's dtype; None when the kernel cannot run."""
    fn = _kernel()
    if fn is None or not x.is_cpu or x.dtype not in _KERNEL_DTYPES or x.dim() != 2 or not w.qweight.is_cpu:
        return None
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, w.out_features), dtype=x.dtype)
    zeros = w.zeros.data_ptr() if w.zeros is not None else None
    status = fn(out.data_ptr(), x.data_ptr(), m, k, w.out_features, _KERNEL_DTYPES[x.dtype], w.qweight.data_ptr(),
                w.bits, w.scales.data_ptr(), zeros, w.group_size, torch.get_num_threads())
    if status != 0:
        raise MemoryError("mmkit: the quantized GEMM kernel could not allocate its scratch buffer")
    return out


def quant_gemm_tiled(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor | None:
    """bf16 x [M, K] (CPU) @ w'^T -> bf16 [M, N] through the tiled kernel; None when it cannot run
    (another dtype, no AVX512-BF16 in the build)."""
    fn = _kernel("mmkit_quant_gemm_tiled")
    if fn is None or not x.is_cpu or x.dtype != torch.bfloat16 or x.dim() != 2 or not w.qweight.is_cpu:
        return None
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, w.out_features), dtype=x.dtype)
    zeros = w.zeros.data_ptr() if w.zeros is not None else None
    status = fn(out.data_ptr(), x.data_ptr(), m, k, w.out_features, w.qweight.data_ptr(), w.bits,
                w.scales.data_ptr(), zeros, w.group_size, torch.get_num_threads())
    if status == 2:
        raise MemoryError("mmkit: the tiled quantized GEMM kernel could not allocate its tile buffers")
    return out if status == 0 else None


class QuantizedLinear(nn.Module):
    """y = x @ ((q - z) * s)^T + b with integer q kept in memory (see the module docstring)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self._qweight: QuantizedWeight | None = qweight
        self.panels: quant_panels.QuantPanels | None = None  # the only copy once packed
        self._run_panels = None
        self._panel_max_rows: int | None = None  # rows above which the row-major path runs (AMX)
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def qweight(self) -> QuantizedWeight:
        """The row-major integers (rebuilt from the panels when packed: tests, odd calls)."""
        return self._qweight if self._qweight is not None else quant_panels.unpack(self.panels)

    @qweight.setter
    def qweight(self, value: QuantizedWeight) -> None:
        self._qweight, self.panels, self._run_panels, self._panel_max_rows = value, None, None, None
        linear_panels.bump_generation()

    @torch.no_grad()
    def pack(self, dtype: torch.dtype) -> bool:
        """For a model whose activations are `dtype`: move the integers into the quantized
        panels (csrc/quant_panels_cpu.c) where that kernel runs (bf16, AVX512-BF16), dropping
        the row-major copy. Returns whether it packed. MMKIT_QUANT_PANELS=0 keeps the row-major
        kernels (A/B)."""
        w = self._qweight
        if (w is None or not envs.MMKIT_QUANT_PANELS or not quant_panels.can_pack(w, dtype)
                or (self.bias is not None and self.bias.dtype != dtype)):
            return self.panels is not None
        self.panels = quant_panels.pack(w)
        self._run_panels = quant_panels.bind(self.panels, self.bias)
        # With AMX, oneDNN's bf16 tiles beat the panels' decoded path above a few rows
        # (linear_panels.BF16_MAX_ROWS): keep the row-major integers for those calls
        # (dequantized per call, then oneDNN), the panels for decode.
        self._panel_max_rows = None if linear_panels.BF16_MAX_ROWS is None else quant_panels.DIRECT_MAX_ROWS
        if self._panel_max_rows is None:
            self._qweight = None
        return True

    def weight_nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        held = (self.panels.nbytes() if self.panels is not None else 0) + \
            (self._qweight.nbytes() if self._qweight is not None else 0)  # both on AMX CPUs
        return held + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self._run_panels
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if run is not None and (self._panel_max_rows is None or flat.shape[0] <= self._panel_max_rows):
            if flat.dtype is torch.bfloat16 and flat.is_cpu and flat.stride(1) == 1:
                return run(flat).reshape(*x.shape[:-1], self.out_features)
            if flat.dtype is torch.bfloat16 and flat.is_cpu:
                return run(flat.contiguous()).reshape(*x.shape[:-1], self.out_features)
        out, rows, qw = None, flat.shape[0], self.qweight
        if run is not None and flat.dtype is torch.bfloat16:  # AMX, many rows: oneDNN on the dequantized weight
            return F.linear(flat, dequantize(qw, flat.dtype), self.bias).reshape(*x.shape[:-1], self.out_features)
        if flat.dtype == torch.bfloat16 and GEMV_MAX_ROWS_BF16[qw.bits] < rows <= TILED_MAX_ROWS:
            out = quant_gemm_tiled(flat, qw)
        elif rows <= KERNEL_MAX_ROWS:
            out = quant_gemm(flat, qw)
        if out is not None and self.bias is not None:
            out += self.bias
        if out is None:
            out = F.linear(flat, dequantize(qw, flat.dtype).to(flat.device), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class Fp8Linear(nn.Module):
    """FP8 weights (float8_e4m3fn [N, K], float32 scales [N, 1]); optional dynamic per-token
    FP8 activations. Computed in the activation dtype on the dequantized weight."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dynamic_activations: bool) -> None:
        super().__init__()
        self.weight_fp8 = weight.contiguous()
        self.scales = scales.float().reshape(weight.shape[0], -1).contiguous()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dynamic_activations = dynamic_activations
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def weight_nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight_fp8.numel() + self.scales.numel() * 4 + bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_fp8.float() * self.scales).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic_activations:
            x = fp8_per_token_round_trip(x)
        return F.linear(x, self.dequantize(x.dtype).to(x.device), self.bias)


def fp8_per_token_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x rounded through e4m3 per token as compressed-tensors does (scale = max|x| / 448, in x's
    dtype; an all-zero row gets the dtype's eps)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / _FP8_MAX
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(x.dtype).eps), scale)
    q = torch.clamp(x / scale, -_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def fuse_quantized(parts: list[nn.Module]) -> nn.Module | None:
    """One layer for row-concatenated projections ([q; k; v], [gate; up]), or None when they are
    not all `QuantizedLinear` / all `Fp8Linear` alike (the caller then keeps them separate)."""
    biases = [p.bias for p in parts]
    bias = None if biases[0] is None else torch.cat(biases)
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return QuantizedLinear(concat_rows([p.qweight for p in parts]), bias)
    if all(isinstance(p, Fp8Linear) for p in parts) and len({p.dynamic_activations for p in parts}) == 1:
        return Fp8Linear(torch.cat([p.weight_fp8 for p in parts]), torch.cat([p.scales for p in parts]), bias,
                         parts[0].dynamic_activations)
    return None
