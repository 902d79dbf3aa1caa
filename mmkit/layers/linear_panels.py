"""Linear weights packed in 32-row panels for mmkit's own GEMM (csrc/bf16_gemm_cpu.c), bf16
and float32.

One copy of each weight serves every batch size: at batch 1 the kernel streams the panels at
close to memory bandwidth (oneDNN's packed bf16 matmul and MKL's float32 GEMV read at about half
of it here), and at 128 rows it keeps up with oneDNN / MKL. Layouts (zero past N and K):

    bf16:    panels[p, kp, c, e] = w[32 p + c, 2 kp + e]   ([P, K / 2, 32, 2]: VDPBF16PS pairs)
    float32: panels[p, k, c]     = w[32 p + c, k]           ([P, K, 32])
             panels[p, h, k, j]  = w[32 p + 16 h + j, k]    ([P, 2, K, 16]: AVX2 builds, `f32_halves()`)

The AVX2 kernel reads a float32 panel in two passes of 16 columns; stored by halves, each pass
is one sequential stream (csrc/linear_panels_cpu.c says why).

On CPUs with AVX512-BF16 (VDPBF16PS) or with AVX2 and FMA (the pairs widened to float32 by a
shift and a mask, exact); elsewhere `available()` is False and `models/llama.py::Linear` keeps
oneDNN's packed weight (bf16) or `F.linear` (float32).
`MMKIT_LINEAR_PANELS=0` turns the panels off (A/B measurements). On CPUs with AMX, oneDNN's
bf16 matmul runs on the tiles and wins above 2 rows, so there a bf16 `Linear` keeps oneDNN's
packed copy as well and uses the panels only for decode's few rows (`BF16_MAX_ROWS`).
"""

from __future__ import annotations

import torch

from mmkit import envs
from mmkit.layers import cpu_kernels

PANEL = 32  # output rows per panel (two 16-float accumulators)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # mmkit_panel_gemm's `dtype`


def _has_amx_bf16() -> bool:
    """The CPU has AMX bf16 tiles (Linux: the `amx_bf16` cpuinfo flag)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def _bf16_max_rows() -> int | None:
    value = envs.MMKIT_PANEL_MAX_ROWS
    if value:
        return value
    # On a CPU with AMX, oneDNN's bf16 matmul runs on the tiles: measured on a 2-core Xeon with
    # AMX (benchmarks/README.md, "Round 4d"), the panels take 0.63x oneDNN's time at 1 row and
    # 0.67x at 2, but 1.17x at 4, 8.6x at 128 and 12x at 2048 rows. There a bf16 `Linear` keeps
    # oneDNN's packed copy beside the panels and sends more than 2 rows to it.
    return 2 if _has_amx_bf16() else None


# bf16 rows up to which the panels run when oneDNN's matmul is faster above (None: every row).
BF16_MAX_ROWS = _bf16_max_rows()


def available() -> bool:
    if not envs.MMKIT_LINEAR_PANELS:
        return False
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.mmkit_panel_gemm_available())


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in _DTYPE_CODES and weight.dim() == 2
            and weight.numel() > 0 and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)
            and available())


def f32_halves() -> bool:
    """This build's float32 panels are stored by halves ([P, 2, K, 16]; the AVX2 kernel)."""
    return bool(cpu_kernels.library().mmkit_panel_f32_halves())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels (module docstring), zero rows past N."""
    n, k = weight.shape
    rows = -(-n // PANEL) * PANEL
    padded = torch.zeros((rows, k), dtype=weight.dtype)
    padded[:n] = weight
    if weight.dtype == torch.bfloat16:
        return padded.view(rows // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if f32_halves():
        return padded.view(rows // PANEL, 2, PANEL // 2, k).permute(0, 1, 3, 2).contiguous()
    return padded.view(rows // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def in_features(panels: torch.Tensor) -> int:
    if panels.dtype == torch.bfloat16:
        return panels.shape[1] * 2
    return panels.shape[2] if panels.dim() == 4 else panels.shape[1]


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The row-major [N, K] weight back from its panels (tests, dequantization)."""
    p, k = panels.shape[0], in_features(panels)
    if panels.dtype == torch.bfloat16:
        order = (0, 2, 1, 3)
    else:
        order = (0, 1, 3, 2) if panels.dim() == 4 else (0, 2, 1)
    return panels.permute(*order).reshape(p * PANEL, k)[:out_features].contiguous()


# Bumped whenever a module (re)binds or drops its panels: the decode stack (models/llama_decode_stack.py)
# holds the bound pointers of every layer and rebuilds when this moves.
_generation = [0]


def generation() -> int:
    return _generation[0]


def bump_generation() -> None:
    _generation[0] += 1


def bind(panels: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    """`run(x) -> x @ w.T + bias` for x [M, K] of the panels' dtype on CPU with dense columns
    (the caller checks; rows may be strided), with the kernel, pointers and sizes looked up once:
    a decode step makes ~120 such calls, and the per-call Python around the kernel was as much
    as a small projection's GEMV (~12 us with the lookups per call, ~4 us bound). The panels and
    the bias must stay alive and in place while `run` is used (the owning module keeps them)."""
    kernel = cpu_kernels.library().mmkit_panel_gemm
    bump_generation()
    k, dtype, code, panels_ptr = in_features(panels), panels.dtype, _DTYPE_CODES[panels.dtype], panels.data_ptr()
    bias_ptr = bias.data_ptr() if bias is not None else None
    empty, threads = torch.empty, torch.get_num_threads

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = empty((m, out_features), dtype=dtype)
        if m and kernel(out.data_ptr(), x.data_ptr(), x.stride(0), m, k, out_features, panels_ptr, bias_ptr, code,
                        threads()):
            raise MemoryError("mmkit_panel_gemm could not allocate its buffer")
        return out

    return run


def bind_silu_mul(panels: torch.Tensor, inter: int, bias: torch.Tensor | None):
    """`run(x) -> silu(x @ wg.T + bg) * (x @ wu.T + bu)` [M, inter] for the panels of a fused
    gate/up projection ([gate | up], 2 * inter outputs): the activation in the GEMM's epilogue,
    bit-identical to `bind(...)` followed by the SiLU-mul kernels. None where the C side's
    `mmkit_panel_gemm_silu_mul_takes` says no: this build has no fused kernel (AVX2), `inter`
    is not a multiple of PANEL (an up panel would start inside a gate panel), or K is past
    where the fused pass was measured to pay (csrc/linear_panels_cpu.c). Same contract as
    `bind` for x and for keeping the tensors alive."""
    lib = cpu_kernels.library()
    k = in_features(panels)
    if panels.shape[0] * PANEL != 2 * inter or not lib.mmkit_panel_gemm_silu_mul_takes(k, inter):
        return None
    kernel = lib.mmkit_panel_gemm_silu_mul
    dtype, code, panels_ptr = panels.dtype, _DTYPE_CODES[panels.dtype], panels.data_ptr()
    bias_ptr = bias.data_ptr() if bias is not None else None
    empty, threads = torch.empty, torch.get_num_threads

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = empty((m, inter), dtype=dtype)
        if m:
            kernel(out.data_ptr(), x.data_ptr(), x.stride(0), m, k, inter, panels_ptr, bias_ptr, code, threads())
        return out

    return run


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] (the panels' dtype; rows may be strided) @ w.T + bias -> [M, N]; None when the
    kernel cannot run on these tensors."""
    if (x.dtype != panels.dtype or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu"
            or x.shape[1] != in_features(panels) or (bias is not None and bias.dtype != x.dtype)):
        return None
    return bind(panels, out_features, bias)(x)
