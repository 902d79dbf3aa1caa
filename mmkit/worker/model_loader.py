"""Build the family's model for a `ModelConfig` and load its checkpoint (vLLM's model loader).

The model is built with its parameters on the meta device (`models/meta_init.py`) and the
loader creates each one directly in the engine's dtype and device from its checkpoint tensor,
so a bf16 engine never holds a float32 copy of the model. Buffers (the rotary cos/sin tables,
the vision towers' position ids and frequencies) are computed at construction in float32, as
transformers computes them, and cast by the final `.to(dtype)` like every other buffer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from mmkit.config import ModelConfig
from mmkit.models.meta_init import meta_parameters, meta_tensor_names
from mmkit.models.quantization import ONLINE_METHODS, quantize_decoder_linears
from mmkit.models.registry import ModelRegistry


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(mc: ModelConfig) -> nn.Module:
    """The family's model for `mc`: weights loaded in `mc.dtype` on `mc.device`, in eval mode,
    `prepare_for_inference` done (packed weights, float32 rotary tables)."""
    model_cls = ModelRegistry.resolve(mc.architecture, mc.model_impl)[0]
    max_positions = max(mc.max_model_len, getattr(mc.hf_config.get_text_config(), "max_position_embeddings", 0) or 0)
    with _default_dtype(torch.float32), torch.device(mc.device), meta_parameters():
        model = model_cls(mc.hf_config, max_positions)
    buffers = meta_tensor_names(model)[1]
    if buffers:  # pragma: no cover - a family computing a buffer from a parameter in __init__
        raise RuntimeError(f"model: buffers {buffers[:5]} of {mc.architecture} were built on the meta device "
                           f"(computed from parameters at construction); they would hold no values")
    model.quantization = mc.quantization  # read by load_vlm_checkpoint (compressed-tensors layers)
    model.load_checkpoint(Path(mc.path), dtype=mc.dtype, device=mc.device)
    if mc.quantization is not None and mc.quantization.method in ONLINE_METHODS:
        quantize_decoder_linears(model, mc.quantization)
    # Parameters are already in mc.dtype: this casts the buffers (as before the meta build).
    model = model.to(dtype=mc.dtype).eval()
    model.prepare_for_inference()
    return model
