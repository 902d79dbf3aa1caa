"""Which checkpoints the transformers backend can run, decided from the config alone.

The backend runs transformers' own modules with mmkit's paged KV cache plugged in through
transformers' `AttentionInterface`, so it takes decoder-only models whose language model is
self-attention only. Everything else is refused here, before any weight is read, with the
reason and the `model_impl` that would run it (vLLM's names):

- encoder-decoders (a separate encoder attended through cross-attention),
- cross-attention layers in the decoder (image features read by cross-attention),
- hybrids: decoder layers that are not attention (recurrent / linear-attention / convolution /
  state-space layers), which keep per-request state the paged KV cache does not hold,
- KV shared between layers (a layer reading another layer's cache),
- a transformers class that does not accept a custom attention function.
"""

from __future__ import annotations

from typing import Any

import transformers

MODEL_IMPLS = ("auto", "mmkit", "transformers")

# `layer_types` entries the backend's attention function computes (mmkit/layers/attention.py
# and models/transformers_backend/attention.py).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Config fields that only exist in models with non-attention decoder layers or shared KV.
_HYBRID_FIELDS = ("layers_block_type", "hybrid_override_pattern", "full_attn_idxs", "conv_L_cache",
                  "mamba_d_state", "ssm_state_size", "linear_num_value_heads", "attn_layer_indices")
_CROSS_ATTENTION_FIELDS = ("cross_attention_layers",)
_SHARED_KV_FIELDS = ("num_kv_shared_layers",)


class BackendUnsupportedError(ValueError):
    """The checkpoint cannot run on the transformers backend (a `ValueError`)."""


def transformers_class(architecture: str) -> type | None:
    """transformers' class of `architecture` (HF `architectures[0]`), or None if it has none."""
    try:
        cls = getattr(transformers, architecture, None)
    except Exception:  # noqa: BLE001 - a lazy import of a class with a missing dependency
        return None
    return cls if isinstance(cls, type) else None


def _what_to_try(native: bool) -> str:
    if native:
        return "run it with model_impl='mmkit' (its native implementation)"
    return ("no mmkit implementation exists for it; register one with mmkit.ModelRegistry.register_model "
            "(model_impl='mmkit')")


def backend_refusal(hf_config: Any, architecture: str, native: bool = False) -> str | None:
    """Why the backend cannot run this checkpoint (one sentence naming the reason and what to
    try), or None when it qualifies. Reads only the config."""
    where = f"model: {architecture} cannot run with model_impl='transformers'"
    try_instead = _what_to_try(native)
    cls = transformers_class(architecture)
    if cls is None:
        return (f"{where}: transformers {transformers.__version__} has no class {architecture!r}; "
                f"{try_instead}")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(hf_config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return f"{where}: it is an encoder-decoder model (the backend runs decoder-only models); {try_instead}"
    for config in (hf_config, text):
        cross = next((f for f in _CROSS_ATTENTION_FIELDS if getattr(config, f, None)), None)
        if cross is not None:
            return (f"{where}: its decoder has cross-attention layers ({cross}={getattr(config, cross)}); "
                    f"the backend runs self-attention decoders only; {try_instead}")
    layer_types = list(getattr(text, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return (f"{where}: it is a hybrid model whose decoder has {other} layers (recurrent, linear-attention "
                f"or convolution state, not a KV cache); the backend runs attention-only decoders "
                f"(layer types {list(ATTENTION_LAYER_TYPES)}); {try_instead}")
    hybrid = next((f for f in _HYBRID_FIELDS if getattr(text, f, None) not in (None, [], ())), None)
    if hybrid is not None:
        return (f"{where}: it is a hybrid model (its text config sets {hybrid!r}: decoder layers that are not "
                f"attention: recurrent, linear-attention or convolution state, not a KV cache); the backend runs "
                f"attention-only decoders; {try_instead}")
    shared = next((f for f in _SHARED_KV_FIELDS if getattr(text, f, None)), None)
    if shared is not None:
        return f"{where}: its layers share KV caches ({shared}={getattr(text, shared)}); {try_instead}"
    if not getattr(cls, "_supports_attention_backend", False) and not _text_model_supports_backend(text):
        return (f"{where}: transformers' {architecture} does not accept a custom attention function "
                f"(_supports_attention_backend is False); {try_instead}")
    return None


def check_backend_supports(hf_config: Any, architecture: str, native: bool = False) -> None:
    """Raise `BackendUnsupportedError` (a ValueError) naming why the backend cannot run it."""
    reason = backend_refusal(hf_config, architecture, native)
    if reason is not None:
        raise BackendUnsupportedError(reason)


def _text_model_supports_backend(text_config: Any) -> bool:
    """Whether the language model's own class takes a custom attention function: the backend
    sets it on the language model only (DeepSeek-VL's composite class does not declare it, its
    Llama decoder does)."""
    try:
        from transformers import AutoModel

        cls = AutoModel._model_mapping[type(text_config)]
    except Exception:  # noqa: BLE001 - no base model class registered for this text config
        return False
    return bool(getattr(cls, "_supports_attention_backend", False))
