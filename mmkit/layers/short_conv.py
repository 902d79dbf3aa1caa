"""Short causal depthwise convolution with a per-sequence window of the last K-1 inputs.

Each channel c of output token t is sum_j w[c, j] * x[t - K + 1 + j, c] (+ bias): the K-1
inputs before a chunk come from the sequence's window (zeros for a fresh sequence, which is
the zero padding of a one-shot forward), so a prompt computed in chunks gives the same rows.
The window kept is the last K-1 inputs, before the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def causal_conv_chunk(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens. x: [T, C]; window: [C, K-1]; weight: [C, K]. Returns
    (out [T, C], the new window [C, K-1])."""
    full = torch.cat([window.to(x.dtype), x.transpose(0, 1)], dim=-1).unsqueeze(0)  # [1, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]  # [C, T]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.transpose(0, 1).to(x.dtype), full[0, :, full.shape[-1] - window.shape[-1]:]


def causal_conv_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B rows. x: [B, C]; windows: [B, C, K-1]. Returns (out [B, C],
    the new windows [B, C, K-1])."""
    full = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])[..., 0]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype), full[..., 1:]
