"""RMSNorm with the same arithmetic as transformers' LlamaRMSNorm (float32 inside)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmkit.layers import cpu_kernels, fused_f32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`, the decoder's
        pre-norm step with the residual add fused in (vLLM's calling convention). With a
        residual, x may be overwritten by the sum: pass a tensor the caller owns."""
        if x.is_cpu and (x.dtype is torch.bfloat16 or x.dtype is torch.float32):
            kernel = cpu_kernels.rms_norm_bf16 if x.dtype is torch.bfloat16 else fused_f32.rms_norm
            out = kernel(x, self.weight, self.eps, residual)
            if out is not None:
                return out if residual is None else (out, x)
        if residual is None:
            return self._norm(x)
        summed = x + residual  # HF: residual + hidden_states (the same rounding)
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in float32 and cast back before the weight, exactly like HF, so
        # float32 outputs are bit-identical and bf16 outputs match HF's rounding.
        # F.rms_norm computes `h * rsqrt(mean(h^2) + eps)` in one kernel (bit-identical to the
        # three-op form in float32); the cast and the weight stay outside, as in HF.
        h = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * h.to(x.dtype)
