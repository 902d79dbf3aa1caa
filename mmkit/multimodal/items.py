"""The items of a prompt: the typed protocol every modality implements, and the image item.

An item is what one placeholder of a prompt stands for (an image, a video, an image's span).
Generic code (the scheduler's cache keys, the encoder cache, the prefetcher) only reads the
`MultiModalItem` protocol; the family's processor builds the concrete items (`ImageItem` here;
a video's `VisionItem` in `processors/qwen2_vl.py`, a span's `SpanItem` in `processors/spans.py`)
and is the only code that reads their pixels.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image

# PIL's own bomb limit is a warning at 89M pixels and an error at 2x that; mmkit refuses
# anything over the warning limit up front, before any resize allocates it.
MAX_IMAGE_PIXELS = 89_478_485


@runtime_checkable
class MultiModalItem(Protocol):
    """One item of a prompt, as the generic input stage sees it."""

    # "image" | "video": which of the processor's `supported_modalities` it is.
    modality: str

    @property
    def processor_options(self) -> dict[str, Any]:
        """The effective `mm_processor_kwargs` this item is processed with (part of its hash)."""
        ...

    @property
    def layout(self) -> str:
        """How the processor lays the item out when that differs by context ("" = default)."""
        ...

    def content_hash(self) -> str:
        """SHA-256 of what the processor will see (pixels, options, layout), computed once:
        the encoder-cache key and part of the prefix-cache keys of the blocks it covers."""
        ...


def check_image_size(where: str, width: int, height: int, what: str = "an image") -> None:
    """At least 1x1 and at most MAX_IMAGE_PIXELS (refused before anything allocates it)."""
    if width < 1 or height < 1:
        raise ValueError(f"{where}: got {what} of size {width}x{height}; expected at least 1x1")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{where}: got {what} of size {width}x{height} ({width * height} pixels), decompression-bomb "
            f"sized; expected at most {MAX_IMAGE_PIXELS} pixels"
        )


# NOTE: a lazily opened PIL file decodes in place on first access and PIL's `load` is not
# thread-safe; a prefetch worker and the engine thread can reach the same image at once.
_DECODE_LOCKS = tuple(threading.RLock() for _ in range(64))  # striped by id(source) >> 4


def _decode_lock(source: Any) -> threading.RLock:
    return _DECODE_LOCKS[(id(source) >> 4) % len(_DECODE_LOCKS)]  # ids are 16-byte aligned


@dataclass
class ImageItem:
    """One validated raw image; converted to PIL only when its request is scheduled."""

    modality = "image"  # a class attribute: every ImageItem is one image
    source: Any  # PIL.Image.Image or a CHW torch tensor
    width: int
    height: int
    where: str = "image"  # e.g. "inputs[3].multi_modal_data[1]", for error messages
    # How the family's processor lays this image out when it differs by context, e.g.
    # LLaVA-OneVision's "base_view" for the images of a multi-image prompt ("" = the default).
    # NOTE: part of the content hash, so cached embeddings and KV blocks never mix layouts.
    layout: str = ""
    _hash: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def processor_options(self) -> dict[str, Any]:
        return {}  # a plain image item's family takes no per-item options

    def content_hash(self) -> str:
        """SHA-256 of the pixels as the image processor will see them (not of a file name),
        with the layout: computed once per item, usually by a prefetch worker ahead of the
        scheduler that needs it for cache keys (a second caller waits for the first). A float
        tensor, the equal uint8 tensor and the equal PIL image hash alike."""
        if self._hash is None:
            with _decode_lock(self.source):
                if self._hash is None:
                    self._hash = self._compute_hash()
        return self._hash

    def _compute_hash(self) -> str:
        img = self.to_pil()
        h = hashlib.sha256()
        h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
        if self.layout:
            h.update(f"layout={self.layout}:".encode())
        h.update(img.tobytes())
        return h.hexdigest()

    def to_pil(self) -> Image.Image:
        """The image as PIL; a lazily opened file that fails to decode is a `ValueError`."""
        if isinstance(self.source, Image.Image):
            return self._loaded_pil(self.source)
        pixels = self.source
        if pixels.dtype != torch.uint8:
            pixels = torch.round(pixels.double() * 255).to(torch.uint8)
        array = pixels.permute(1, 2, 0).contiguous().cpu().numpy()  # [H, W, C]
        if array.shape[2] == 1:
            return Image.fromarray(array[:, :, 0], mode="L")
        return Image.fromarray(array, mode="RGB")

    def _loaded_pil(self, img: Image.Image) -> Image.Image:
        # A lazily opened file (Image.open) decodes on first load; its errors name the input.
        try:
            with _decode_lock(img):
                img.load()
        except Exception as exc:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ...
            name = getattr(img, "filename", "") or "PIL image"
            raise ValueError(
                f"{self.where}: image '{name}' could not be decoded ({type(exc).__name__}: {exc}); "
                "expected a complete, readable image"
            ) from exc
        return img
