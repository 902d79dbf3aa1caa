"""bf16 linear weights packed in 32-row panels for mmkit's own GEMM (csrc/bf16_gemm_cpu.c).

One copy of each bf16 weight serves every batch size: at batch 1 the kernel streams the panels
at close to memory bandwidth (about 1.5-2x oneDNN's packed matmul there), and at 128 rows it
keeps up with oneDNN. Only on CPUs with AVX512-BF16 (VDPBF16PS); elsewhere `available()` is
False and `models/llama.py::Linear` keeps oneDNN's packed weight. `MMKIT_BF16_PANELS=0` turns it
off (A/B measurements).
"""

from __future__ import annotations

import os

import torch

from mmkit.layers import cpu_kernels

PANEL = 32  # output rows per panel (two 16-float accumulators)


def available() -> bool:
    if os.environ.get("MMKIT_BF16_PANELS", "1") == "0":
        return False
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.mmkit_bf16_panel_gemm_available())


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.numel() > 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> panels [ceil(N / 32), K / 2, 32, 2] (zero rows past N):
    panels[p, kp, c, e] = weight[32 p + c, 2 kp + e]."""
    n, k = weight.shape
    rows = -(-n // PANEL) * PANEL
    padded = torch.zeros((rows, k), dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(rows // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The row-major [N, K] weight back from its panels (state_dict, dequantization, tests)."""
    p, kp, _, _ = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * PANEL, kp * 2)[:out_features].contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] bf16 (rows may be strided) @ w.T + bias -> [M, N] bf16; None when the kernel
    cannot run on these tensors."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" \
            or x.shape[1] != panels.shape[1] * 2:
        return None
    lib = cpu_kernels.library()
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    if x.shape[0] == 0:
        return out
    status = lib.mmkit_bf16_panel_gemm(out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                                       out_features, panels.data_ptr(),
                                       bias.data_ptr() if bias is not None else None, torch.get_num_threads())
    return out if status == 0 else None
