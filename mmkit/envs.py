"""Environment switches mmkit reads, in one place (vLLM's `vllm/envs.py`, with the MMKIT_ prefix).

Each is read when it is used, not at import, so a test's `monkeypatch.setenv` or a server's
environment takes effect without reloading anything:

    from mmkit import envs
    envs.MMKIT_IMAGE_FETCH_TIMEOUT   # -> 10.0 unless the variable says otherwise

A value that does not parse is a `ValueError` naming the variable, what it held and what it expects.

Media fetching (images given as http(s) URLs to `LLM.chat` and `mmkit serve`; docs/serving.md,
"Media fetching"). Each is the default of the `EngineArgs` field / `mmkit serve` flag beside it:

| variable                         | default     | field / flag                                      | vLLM                             |
|----------------------------------|-------------|---------------------------------------------------|----------------------------------|
| MMKIT_IMAGE_FETCH_TIMEOUT        | 10          | image_fetch_timeout / --image-fetch-timeout       | VLLM_IMAGE_FETCH_TIMEOUT (5)     |
| MMKIT_MAX_IMAGE_FETCH_BYTES      | 20971520    | max_image_fetch_bytes / --max-image-fetch-bytes   | -                                |
| MMKIT_MAX_IMAGE_PIXELS           | 89478485    | max_image_pixels / --max-image-pixels             | -                                |
| MMKIT_MEDIA_URL_ALLOW_REDIRECTS  | 1           | (environment only, as in vLLM)                    | VLLM_MEDIA_URL_ALLOW_REDIRECTS   |

Serving and plugins:

| variable          | default | meaning                                                                  |
|-------------------|---------|--------------------------------------------------------------------------|
| MMKIT_API_KEY     | unset   | `mmkit serve --api-key`'s default (docs/serving.md)                      |
| MMKIT_PLUGINS     | unset   | comma-separated plugin names to load (unset: all installed; "": none)    |

CPU kernels and A/B switches (docs/speed.md). A switch that is on by default is off only for "0";
one that is off by default is on for any value but "" and "0" (how they have always read):

| variable                   | default        | meaning                                                          |
|----------------------------|----------------|------------------------------------------------------------------|
| MMKIT_CPU_KERNELS          | 1              | build and use the C kernels (0: torch ops only)                  |
| MMKIT_REQUIRE_CPU_KERNELS  | 0              | a failed kernel build is an error (CI sets it)                   |
| MMKIT_KERNEL_GENERIC       | 0              | build portable code paths (no -march=native)                     |
| MMKIT_KERNEL_NO_AVX512     | 0              | build the AVX2 paths on an AVX-512 CPU                           |
| MMKIT_KERNEL_CHECKS        | 0              | bounds checks in the attention and KV-write kernels              |
| MMKIT_CACHE_DIR            | ~/.cache/mmkit | where built kernels are cached                                   |
| MMKIT_DECODE_STACK         | 1              | the fused decode stack for eligible decoders                     |
| MMKIT_FUSED_F32            | 1              | fused float32 elementwise kernels                                |
| MMKIT_LINEAR_PANELS        | 1              | packed weight panels for `Linear`                                |
| MMKIT_PANEL_MAX_ROWS       | auto           | bf16 rows up to which panels run (auto: 2 with AMX, else all)    |
| MMKIT_QUANT_PANELS         | 1              | packed panels for quantized linears                              |
| MMKIT_PACKED_LINEAR        | 1              | oneDNN-packed bf16 weights beside the panels                     |
| MMKIT_BACKEND_PACKED_LINEAR| 1              | the transformers backend's linears on mmkit's packed `Linear`    |
| MMKIT_GEMV_MAX_ROWS        | 16             | float32 rows up to which `Linear` runs the C GEMV (0: never)     |
| MMKIT_PAGED_PREFILL        | 1              | the paged prefill attention kernel (0: one SDPA call per chunk)  |
| MMKIT_KV_WARM              | 1              | decode stack: the MLP's GEMMs warm the next layer's K/V into cache |
| MMKIT_KV_HUGEPAGES         | unset          | 1 / 0: advise the CPU KV cache huge pages, or not (unset: only a preallocated one) |
"""

from __future__ import annotations

import os
from typing import Any, Callable

from mmkit.multimodal.items import MAX_IMAGE_PIXELS

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _positive_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: got {raw!r}; expected a positive number of seconds")
    return value


def _positive_int(name: str, default: int, upper: int | None = None) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0 or (upper is not None and value > upper):
        bound = f" at most {upper}" if upper is not None else ""
        raise ValueError(f"{name}: got {raw!r}; expected a positive integer{bound}")
    return value


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}: got {raw!r}; expected 1 or 0 (true/false)")


def _optional_flag(name: str) -> bool | None:
    """None when unset (the caller's own default), else `_flag`'s reading."""
    return _flag(name, False) if os.environ.get(name, "").strip() else None


def _on_unless_zero(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def _on_if_set(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def _optional_str(name: str) -> str | None:
    return os.environ.get(name)


def _optional_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: got {raw!r}; expected an integer") from None


def _int(name: str, default: int) -> int:
    value = _optional_int(name)
    return default if value is None else value


_ON_BY_DEFAULT = ("MMKIT_CPU_KERNELS", "MMKIT_DECODE_STACK", "MMKIT_FUSED_F32", "MMKIT_LINEAR_PANELS",
                  "MMKIT_QUANT_PANELS", "MMKIT_PACKED_LINEAR", "MMKIT_PAGED_PREFILL",
                  "MMKIT_BACKEND_PACKED_LINEAR", "MMKIT_KV_WARM")
_OFF_BY_DEFAULT = ("MMKIT_REQUIRE_CPU_KERNELS", "MMKIT_KERNEL_GENERIC", "MMKIT_KERNEL_NO_AVX512",
                   "MMKIT_KERNEL_CHECKS")

#: name -> how to read it. Documented in the module docstring's tables.
environment_variables: dict[str, Callable[[], Any]] = {
    # Seconds a WHOLE image download may take (connect, headers and body together).
    "MMKIT_IMAGE_FETCH_TIMEOUT": lambda: _positive_float("MMKIT_IMAGE_FETCH_TIMEOUT", 10.0),
    # The largest body accepted from an image URL, in bytes (20 MiB).
    "MMKIT_MAX_IMAGE_FETCH_BYTES": lambda: _positive_int("MMKIT_MAX_IMAGE_FETCH_BYTES", 20 << 20),
    # Width x height of an image mmkit loads (URL, path, data URI), checked from its header
    # before decoding; at most PIL's decompression-bomb limit, which always applies.
    "MMKIT_MAX_IMAGE_PIXELS": lambda: _positive_int("MMKIT_MAX_IMAGE_PIXELS", MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS),
    # Whether image URLs may redirect (to an allowed host only, when --allowed-media-domains is set).
    "MMKIT_MEDIA_URL_ALLOW_REDIRECTS": lambda: _flag("MMKIT_MEDIA_URL_ALLOW_REDIRECTS", True),
    "MMKIT_API_KEY": lambda: _optional_str("MMKIT_API_KEY"),
    "MMKIT_PLUGINS": lambda: _optional_str("MMKIT_PLUGINS"),
    "MMKIT_CACHE_DIR": lambda: _optional_str("MMKIT_CACHE_DIR") or None,
    "MMKIT_PANEL_MAX_ROWS": lambda: _optional_int("MMKIT_PANEL_MAX_ROWS") or None,
    "MMKIT_GEMV_MAX_ROWS": lambda: _int("MMKIT_GEMV_MAX_ROWS", 16),
    # Unset: huge pages for a preallocated CPU KV cache only (worker/kv_cache.py says why).
    "MMKIT_KV_HUGEPAGES": lambda: _optional_flag("MMKIT_KV_HUGEPAGES"),
    **{name: (lambda name=name: _on_unless_zero(name)) for name in _ON_BY_DEFAULT},
    **{name: (lambda name=name: _on_if_set(name)) for name in _OFF_BY_DEFAULT},
}

# Static names for type checkers and readers; the values come from `__getattr__`.
MMKIT_IMAGE_FETCH_TIMEOUT: float
MMKIT_MAX_IMAGE_FETCH_BYTES: int
MMKIT_MAX_IMAGE_PIXELS: int
MMKIT_MEDIA_URL_ALLOW_REDIRECTS: bool
MMKIT_API_KEY: str | None
MMKIT_PLUGINS: str | None
MMKIT_CACHE_DIR: str | None
MMKIT_PANEL_MAX_ROWS: int | None
MMKIT_GEMV_MAX_ROWS: int
MMKIT_CPU_KERNELS: bool
MMKIT_DECODE_STACK: bool
MMKIT_KV_WARM: bool
MMKIT_FUSED_F32: bool
MMKIT_LINEAR_PANELS: bool
MMKIT_QUANT_PANELS: bool
MMKIT_PACKED_LINEAR: bool
MMKIT_BACKEND_PACKED_LINEAR: bool
MMKIT_PAGED_PREFILL: bool
MMKIT_REQUIRE_CPU_KERNELS: bool
MMKIT_KERNEL_GENERIC: bool
MMKIT_KERNEL_NO_AVX512: bool
MMKIT_KERNEL_CHECKS: bool
MMKIT_KV_HUGEPAGES: bool | None


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(environment_variables)
