"""Which attention implementation reads the paged cache: chosen once, when the runner is built.

- "torch": the CPU engine's path (`mmkit/layers/attention.py`: the C kernels on CPU, a
  gather + SDPA elsewhere). The CPU default, unchanged.
- "flex": torch's FlexAttention with a paged block mask (`mmkit/layers/flex_attention.py`),
  compiled to Triton on CUDA. The CUDA default: it ships with torch, so the lent GPU image
  (torch + Triton, no network) runs it.
- "flashinfer", "flash_attn": maintained CUDA kernels that read a paged cache, recognised
  when their package is installed. mmkit does not drive them yet (their cache layouts are
  block-major, `[num_blocks, block_size, kv_heads, head_dim]`); asking for one is a clear
  error that names what to use instead, never a silent fallback.

`attention_backend="auto"` picks "flex" on CUDA (when torch has it) and "torch" elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from mmkit.layers import flex_attention as flex

BACKENDS = ("auto", "torch", "flex", "flashinfer", "flash_attn")
# The package each optional backend imports.
_PACKAGES = {"flashinfer": "flashinfer", "flash_attn": "flash_attn"}


def is_installed(backend: str) -> bool:
    package = _PACKAGES.get(backend)
    return package is None or importlib.util.find_spec(package) is not None


def available_backends(device: torch.device) -> list[str]:
    """The backends that can run on `device` in this environment."""
    names = ["torch"]
    if flex.is_available():
        names.append("flex")
    if device.type == "cuda":
        names.extend(b for b in _PACKAGES if is_installed(b))
    return names


def flex_block_size_ok(block_size: int) -> bool:
    """FlexAttention's Triton kernels tile a KV block by BLOCK_N (a power of two >= 16) dividing it."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def select_attention_backend(device: torch.device, requested: str = "auto", block_size: int = 16) -> str:
    """The backend name for `device`; a `ValueError` naming the choices when it cannot run.
    On CUDA "flex" needs a `block_size` that is a power of two >= 16 ("auto" then falls back
    to "torch")."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend: got {requested!r}; expected one of {list(BACKENDS)}")
    cuda_flex_ok = flex.is_available() and flex_block_size_ok(block_size)
    if requested == "auto":
        return "flex" if device.type == "cuda" and cuda_flex_ok else "torch"
    if requested == "flex" and device.type == "cuda" and not flex_block_size_ok(block_size):
        raise ValueError(f"attention_backend: 'flex' on CUDA needs block_size a power of two >= 16; got "
                         f"block_size={block_size} (use block_size=16 or attention_backend='torch')")
    if requested in _PACKAGES:
        if device.type != "cuda":
            raise ValueError(f"attention_backend: {requested!r} runs on CUDA only; device is {device.type!r} "
                             f"(use 'torch' or 'flex')")
        if not is_installed(requested):
            raise ValueError(f"attention_backend: {requested!r} is not installed (no package "
                             f"{_PACKAGES[requested]!r}); use 'flex' (torch's FlexAttention)")
        raise ValueError(f"attention_backend: {requested!r} is installed but mmkit does not drive it yet; "
                         f"use 'flex' (torch's FlexAttention, the CUDA default)")
    if requested == "flex" and not flex.is_available():
        raise ValueError("attention_backend: 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    return requested


@functools.lru_cache(maxsize=None)
def compiled_flex_attention() -> Callable:
    """FlexAttention compiled once per process (Triton on CUDA). Shapes vary per step, so
    dynamic shapes are on; CUDA-graph capture sizes fix them per captured batch."""
    return torch.compile(flex.flex_attention, dynamic=True)


@dataclass
class FlexAttend:
    """The callable `paged_attention` hands a step to when the runner chose "flex"
    (`AttentionMetadata.attend`): the step's FlexMetadata, built once, shared by the layers."""

    meta: flex.FlexMetadata
    attend: Callable | None = None
    softcap: float | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
        return flex.flex_paged_attention(q, k_cache, v_cache, self.meta, scale, sliding_window, self.softcap,
                                         attend=self.attend)


def attach_backend(meta, backend: str, num_blocks: int) -> None:
    """Route the step's attention through `backend` (a no-op for "torch")."""
    if backend == "flex":
        on_cuda = meta.slot_mapping.device.type == "cuda"
        meta.attend = FlexAttend(flex.build_flex_metadata(meta, num_blocks),
                                 attend=compiled_flex_attention() if on_cuda else None)
