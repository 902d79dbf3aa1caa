"""Which decoder layers attend through a sliding window, read from the HF text config the way
transformers decides it (no family names: the config's own keys say it).

- `layer_types` (Gemma 3, Qwen2, Ministral, ...): layer i slides when its entry is
  "sliding_attention"; Gemma 3's older `sliding_window_pattern` is turned into `layer_types`
  by `Gemma3TextConfig` itself, and Qwen2's config drops `sliding_window` unless
  `use_sliding_window` is set (its `max_window_layers` then picks the sliding layers).
- otherwise a `sliding_window` alone (Mistral v0.1): every layer slides.

A layer with window W lets the query at position p attend keys in (p - W, p] (transformers'
`sliding_window_overlay`).
"""

from __future__ import annotations

from typing import Any


def layer_windows(text_config: Any) -> list[int | None]:
    """One entry per decoder layer: its window in tokens, or None for global attention."""
    num_layers = int(text_config.num_hidden_layers)
    window = getattr(text_config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        return [int(window)] * num_layers
    if len(layer_types) < num_layers:
        raise ValueError(f"model: layer_types lists {len(layer_types)} layers; expected {num_layers}")
    return [int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers]]


def kv_window(windows: list[int | None]) -> int | None:
    """The window when every layer slides (KV blocks entirely before it can be freed), else None."""
    if windows and all(w is not None for w in windows):
        return max(windows)  # type: ignore[type-var]
    return None
