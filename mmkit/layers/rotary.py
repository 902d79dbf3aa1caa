"""Rotary position embedding: a cos/sin table built once from the HF config.

The inverse frequencies come from transformers' own rotary module, so every RoPE variant
the HF config names (default, linear, dynamic-free llama3, yarn, ...) is computed the way
the reference computes it; mmkit only tabulates and indexes it by position.
"""

from __future__ import annotations

import torch
from torch import nn

from mmkit.layers import cpu_kernels, fused_f32


class RotaryEmbedding(nn.Module):
    def __init__(self, text_config, max_positions: int, mrope_section: list[int] | None = None,
                 mrope_interleaved: bool = False, hf_rotary=None) -> None:
        """`mrope_section` overrides the config's; `mrope_interleaved`: Qwen3-VL's layout (below).
        `hf_rotary`: a family's own transformers rotary, called as `hf_rotary(x, position_ids) ->
        (cos, sin)` (e.g. one layer type's of a decoder with per-layer-type bases); default
        transformers' Llama rotary of `text_config`."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_rope = hf_rotary or LlamaRotaryEmbedding(text_config)
        positions = torch.arange(max_positions)[None]  # [1, max_positions]
        dummy = torch.zeros(1, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = hf_rope(dummy, positions)  # [1, max_positions, head_dim], float32
        # NOTE: only cos and the signed sin below are kept (a [max_positions, head_dim] float32
        # table each: 128 MiB apiece at 131072 positions x head_dim 256).
        self.register_buffer("cos", cos[0], persistent=False)
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half of sin negated:
        # one roll instead of neg + cat, bit-identical (negation commutes with rounding).
        half = cos.shape[-1] // 2
        signed = sin[0].clone()
        signed[:, :half] = -signed[:, :half]
        self.register_buffer("signed_sin", signed, persistent=False)
        # M-RoPE (Qwen2-VL): frequency i of each half takes its angle from position row
        # mrope_row[i] (0 temporal, 1 height, 2 width), transformers' `mrope_section` split.
        rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
        section = mrope_section or (rope.get("mrope_section") if isinstance(rope, dict) else None)
        self.mrope_row: torch.Tensor | None = None
        if section:
            if sum(section) != half:
                raise ValueError(f"model: mrope_section {section} sums to {sum(section)}; expected head_dim / 2 "
                                 f"= {half}")
            if mrope_interleaved:
                # Qwen3-VL (transformers' `recomposition_frequencies`): temporal everywhere except
                # frequencies 1, 4, 7, ... (height, the first 3 * section[1]) and 2, 5, 8, ... (width).
                rows = torch.zeros(half, dtype=torch.long)
                rows[1:3 * section[1]:3] = 1
                rows[2:3 * section[2]:3] = 2
            else:
                rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
            self.mrope_row = torch.cat([rows, rows])  # [head_dim]

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> "StepRope":
        """positions: [num_tokens], or [3, num_tokens] M-RoPE rows."""
        if positions.dim() == 2:
            return StepRope(_MRopeTables(self, positions), torch.arange(positions.shape[1], device=positions.device),
                            dtype)
        return StepRope(self, positions, dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] cos and signed sin in `dtype` (cast from float32, as HF does)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1)


class _MRopeTables:
    """This step's M-RoPE angles tabulated per token: row t holds token t's cos / signed sin
    ([num_tokens, head_dim], float32), each dimension read at its section's position row. The
    rotation code (torch and the bf16 C kernel) then indexes them by 0..num_tokens-1 as it
    indexes the 1-D tables by position: the same arithmetic, only the lookup differs."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
        if rotary.mrope_row is None:
            raise ValueError("rotary: got [3, num_tokens] positions for a model without mrope_section")
        dims = torch.arange(rotary.cos.shape[1], device=positions.device)
        index = positions[rotary.mrope_row.to(positions.device)].T  # [num_tokens, head_dim]
        self.cos = rotary.cos[index, dims].contiguous()
        self.signed_sin = rotary.signed_sin[index, dims].contiguous()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return RotaryEmbedding.cos_sin(self, positions, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim] (from `cos_sin`).

    Equals HF's `x * cos + rotate_half(x) * sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class StepRope:
    """The rotary embedding of one step's positions, shared by every layer.

    bf16 and float32 on CPU rotate in place with a C kernel, reading the float32 tables by position;
    otherwise cos/sin are gathered once (first use) and `apply_rotary` runs as torch ops.
    """

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.use_kernel = dtype in (torch.bfloat16, torch.float32) and positions.device.type == "cpu"

    def rotate(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Rotate heads [0, num_heads) of x ([num_tokens, heads, head_dim], e.g. the fused qkv
        output with q and k first); returns them as [num_tokens, num_heads, head_dim]. x itself
        may be rotated in place."""
        if self.use_kernel:
            kernel = cpu_kernels.rotary_bf16_ if self.dtype == torch.bfloat16 else fused_f32.rotary_
            if kernel(x, num_heads, self.positions, self.rotary.cos, self.rotary.signed_sin):
                return x[:, :num_heads]
            self.use_kernel = False  # kernel unavailable or layout unsupported: torch from now on
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return apply_rotary(x[:, :num_heads], *self._cos_sin)
