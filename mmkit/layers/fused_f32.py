"""float32 fused CPU kernels (`csrc/elementwise_f32_cpu.c`): residual add + RMSNorm, rotary in
place, SiLU(gate) * up, the float32 twins of `cpu_kernels`' bf16 ones.

The rotary embedding and the residual add are bit-identical to the torch ops; RMSNorm's sum of
squares and SiLU's exp are computed in another order / with another exp and can differ by one
float32 ulp (see the C file). `MMKIT_FUSED_F32=0` keeps the torch ops (A/B measurements, or a
bit-for-bit comparison with transformers' intermediate tensors). Each wrapper returns None /
False when the kernel cannot run, and the caller then runs the torch ops.
"""

from __future__ import annotations

import torch

from mmkit import envs
from mmkit.layers import cpu_kernels


def enabled() -> bool:
    return envs.MMKIT_FUSED_F32


def _f32_rows(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()):
            return False
    return True


def _lib():
    return cpu_kernels.library() if enabled() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """`weight * (h * rsqrt(mean(h^2) + eps))` for h = x, or h = x + residual stored into x (in
    place: x becomes the residual stream; `residual` is only read). x, residual: [tokens, hidden]."""
    lib = _lib()
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if lib is None or x.dim() != 2 or not _f32_rows(*tensors):
        return None
    out = torch.empty_like(x)
    lib.mmkit_rms_norm_f32(out.data_ptr(), x.data_ptr(), (residual if residual is not None else x).data_ptr(),
                           weight.data_ptr(), x.shape[0], x.shape[1], eps, residual is not None,
                           torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
            signed_sin: torch.Tensor) -> bool:
    """Rotate heads [0, num_heads) of x ([tokens, heads, head_dim] float32, contiguous) in place."""
    lib = _lib()
    if (lib is None or x.dim() != 3 or not _f32_rows(x) or positions.dtype != torch.long
            or not _f32_rows(cos, signed_sin)):
        return False
    positions = positions.contiguous()
    lib.mmkit_rotary_f32(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                         x.shape[0], x.stride(0), num_heads, x.shape[2], torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` for gate_up = [gate | up] ([tokens, 2 * inter] float32)."""
    lib = _lib()
    if lib is None or gate_up.dim() != 2 or not _f32_rows(gate_up):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    lib.mmkit_silu_mul_f32(out.data_ptr(), gate_up.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
    return out
