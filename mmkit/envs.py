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


#: name -> how to read it. Documented in the module docstring's table.
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
}

# Static names for type checkers and readers; the values come from `__getattr__`.
MMKIT_IMAGE_FETCH_TIMEOUT: float
MMKIT_MAX_IMAGE_FETCH_BYTES: int
MMKIT_MAX_IMAGE_PIXELS: int
MMKIT_MEDIA_URL_ALLOW_REDIRECTS: bool


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(environment_variables)
