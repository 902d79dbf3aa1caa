"""Load images from the places users keep them, with errors that say which one failed.

`load_image(source, where=...)` takes a file path (str or `pathlib.Path`), a `file://` URL, a
`data:image/...;base64,` URI, raw encoded bytes, an `http(s)://` URL or an already open PIL
image, and returns a fully decoded `PIL.Image.Image`. Every failure (missing file, not an
image, corrupt or truncated data, a decompression bomb, a network error, a media limit) is a `ValueError`
whose message holds `where` (say `"messages[0].content[1]"`), the source's name and what was
expected; PIL's own `OSError` / `UnidentifiedImageError` never escape.

    from mmkit.multimodal.image_io import load_image
    img = load_image("photos/cat.jpg", where="inputs[3]")

Modes: L, RGB, RGBA and P are returned as PIL decodes them (the model's HF image processor
converts to RGB, exactly as it does for an image the user opened); the modes a processor may
not expect are normalized: 1 -> L, LA/PA -> RGBA, CMYK/YCbCr/LAB/HSV -> RGB, 16- and 32-bit
integer or float grayscale -> L (scaled to 0-255). EXIF orientation is applied, as
`transformers.image_utils.load_image` does.

Limits and allow-lists (download timeout and size, max pixels, allowed local folder and hosts)
come from a `MediaConnector` (mmkit/multimodal/media_fetch.py); without one, the permissive
default with the environment's limits (mmkit/envs.py) applies.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmkit.multimodal.items import MAX_IMAGE_PIXELS, check_image_size
from mmkit.multimodal.media_fetch import MediaConnector

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Image.Image]

#: Seconds a whole http(s) download may take by default (env MMKIT_IMAGE_FETCH_TIMEOUT overrides it).
HTTP_TIMEOUT_S = 10.0
#: The largest encoded image accepted from a file, data URI or bytes (a guard, not a format limit;
#: a download stops at the smaller `max_image_fetch_bytes`, mmkit/multimodal/media_fetch.py).
MAX_IMAGE_BYTES = 256 * 1024 * 1024

_KEPT_MODES = ("L", "RGB", "RGBA", "P")
_TO_RGB_MODES = ("CMYK", "YCbCr", "LAB", "HSV")
_EXPECTED = "an image file PIL can decode (PNG, JPEG, GIF, BMP, WebP, TIFF, ...)"

__all__ = ["load_image", "load_image_bytes", "ImageSource", "HTTP_TIMEOUT_S", "MAX_IMAGE_BYTES"]


def load_image(source: ImageSource, *, where: str, timeout: float | None = None,
               media: MediaConnector | None = None) -> Image.Image:
    """Read and fully decode one image; any failure is a `ValueError` naming `where` and the source.

    `source`: a path (str or PathLike), `file://` URL, `data:image/<fmt>;base64,<data>` URI,
    `http://`/`https://` URL (the whole download within `timeout` seconds), encoded bytes, or a
    PIL image (decoded and mode-normalized like the others). `media`: the allow-lists and limits
    (default: any local file or host, the environment's limits); `timeout` overrides its
    `image_fetch_timeout`. The result holds its pixels in memory: no file handle stays open.
    """
    media = media if media is not None else MediaConnector()
    if timeout is not None:
        media = media.replace(image_fetch_timeout=timeout)
    if isinstance(source, Image.Image):
        name = _pil_name(source)
        return _finish(source, where, name, media)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return load_image_bytes(bytes(source), where=where, name=f"bytes ({len(source)} bytes)", media=media)
    if isinstance(source, os.PathLike):
        return _load_path(Path(source), os.fspath(source), where, media)
    if not isinstance(source, str):
        raise TypeError(
            f"{where}: got {type(source).__name__}; expected a file path, a file:// or http(s):// URL, "
            "a data:image/...;base64 URI, encoded image bytes or a PIL image"
        )
    if source == "":
        raise ValueError(f"{where}: got an empty string; expected an image path, URL or data URI")
    lowered = source[:16].lower()
    if lowered.startswith("data:"):
        return _load_data_uri(source, where, media)
    if lowered.startswith("file:"):
        return _load_path(_file_url_to_path(source, where), source, where, media)
    if lowered.startswith(("http://", "https://")):
        name = f"URL '{source[:200]}'"
        return load_image_bytes(media.fetch(source, where), where=where, name=name, media=media)
    if "://" in lowered:
        scheme = source.split("://", 1)[0]
        raise ValueError(f"{where}: got a URL with scheme {scheme!r}; expected a data:image/...;base64 URI, "
                         "http(s):// or file://, or a local path")
    return _load_path(Path(source), source, where, media)


def load_image_bytes(data: bytes, *, where: str, name: str = "bytes",
                     media: MediaConnector | None = None) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, ...); `name` says where they came from in errors.
    The size is checked against `media`'s `max_image_pixels` from the header, before decoding."""
    media = media if media is not None else MediaConnector()
    if len(data) == 0:
        raise ValueError(f"{where}: {name} is empty (0 bytes); expected {_EXPECTED}")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: {name} holds {len(data)} bytes; expected at most {MAX_IMAGE_BYTES}")
    with warnings.catch_warnings():
        # PIL warns (rather than fails) between its limit and twice it: refuse those too.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        img = _decode_step(lambda: Image.open(io.BytesIO(data)), where, name, _sniff_format(data))
        _check_pixels(img.size, where, name, media)  # from the header, before decoding allocates the pixels
        _decode_step(img.load, where, name)  # a truncated file fails here, not in a later engine step
    return _finish(img, where, name, media)


# ---------------------------------------------------------------------- sources
def _load_path(path: Path, shown: str, where: str, media: MediaConnector) -> Image.Image:
    path = media.check_local_path(path, shown, where)
    name = f"file '{path}'"
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ValueError(f"{where}: {name} does not exist; expected a path to an existing image file") from exc
    except IsADirectoryError as exc:
        raise ValueError(f"{where}: {name} is a directory; expected an image file") from exc
    except OSError as exc:
        raise ValueError(f"{where}: {name} cannot be read ({exc.strerror or exc}); expected a readable "
                         "image file") from exc
    return load_image_bytes(data, where=where, name=name, media=media)


def _file_url_to_path(url: str, where: str) -> Path:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: got file URL {url!r} on host {parsed.netloc!r}; expected a local "
                         "file:///path URL")
    return Path(urllib.request.url2pathname(parsed.path))


def _load_data_uri(uri: str, where: str, media: MediaConnector) -> Image.Image:
    header, sep, payload = uri.partition(",")
    kind = header[len("data:"):]
    shown = header if len(header) <= 40 else header[:37] + "..."
    if not sep or not kind.lower().startswith("image/") or not kind.lower().endswith(";base64"):
        raise ValueError(f"{where}: got data URI '{shown},...'; expected 'data:image/<format>;base64,<data>'")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: the data URI's base64 payload is invalid ({exc}); expected "
                         "standard base64 of an image file") from exc
    return load_image_bytes(data, where=where, name=f"data URI ({kind})", media=media)


# ---------------------------------------------------------------------- checks and modes
def _check_pixels(size: tuple[int, int], where: str, name: str, media: MediaConnector) -> None:
    width, height = size
    limit = media.max_image_pixels
    if limit < MAX_IMAGE_PIXELS and width * height > limit:
        raise ValueError(f"{where}: {name} is an image of {width}x{height} ({width * height} pixels), over the "
                         f"pixel limit of {limit} {media.limit('max_image_pixels')}; expected at most {limit} pixels")
    check_image_size(where, width, height, what=f"{name}, an image")


def _finish(img: Image.Image, where: str, name: str, media: MediaConnector) -> Image.Image:
    _check_pixels(img.size, where, name, media)
    try:
        img.load()
        img = ImageOps.exif_transpose(img)  # a copy only when the EXIF says to rotate
        return _normalize_mode(img)
    except Exception as exc:  # noqa: BLE001 - a lazily opened PIL image may still be corrupt
        raise _corrupt(where, name, exc) from exc


def _normalize_mode(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode in _KEPT_MODES:
        return img
    if mode == "1":
        return img.convert("L")
    if mode in ("LA", "La", "PA", "RGBa", "RGBX"):
        return img.convert("RGBA" if mode != "RGBX" else "RGB")
    if mode in _TO_RGB_MODES:
        return img.convert("RGB")
    if mode.startswith("I") or mode == "F":
        return _scale_to_l(img)
    return img.convert("RGB")


def _scale_to_l(img: Image.Image) -> Image.Image:
    """16/32-bit integer or float grayscale -> 8-bit L, keeping the relative brightness."""
    array = np.asarray(img, dtype=np.float64)
    if img.mode.startswith("I;16"):
        top = 65535.0
    elif img.mode == "F" and array.size and float(np.nanmax(array)) <= 1.0:
        top = 1.0
    else:
        peak = float(np.nanmax(array)) if array.size else 0.0
        top = 255.0 if peak <= 255 else (65535.0 if peak <= 65535 else peak)
    array = np.nan_to_num(array, nan=0.0, posinf=top, neginf=0.0)
    scaled = np.clip(np.round(array * (255.0 / top)), 0, 255).astype(np.uint8)
    return Image.fromarray(scaled, mode="L")


_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
          (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def _sniff_format(data: bytes) -> str | None:
    """The format the first bytes announce (so a damaged PNG is called corrupt, not 'not an image')."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((fmt for magic, fmt in _MAGIC if data.startswith(magic)), None)


def _decode_step(fn, where: str, name: str, sniffed: str | None = None):
    try:
        return fn()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(
            f"{where}: {name} is a decompression-bomb sized image ({exc}); expected at most "
            f"{MAX_IMAGE_PIXELS} pixels"
        ) from exc
    except UnidentifiedImageError as exc:
        if sniffed is not None:
            raise ValueError(f"{where}: {name} starts like a {sniffed} file but is corrupt (PIL cannot read it); "
                             f"expected {_EXPECTED}") from exc
        raise ValueError(f"{where}: {name} is not an image (format not recognized); expected {_EXPECTED}") \
            from exc
    except Exception as exc:  # noqa: BLE001 - PIL decoders raise OSError, SyntaxError, IndexError, ...
        raise _corrupt(where, name, exc) from exc


def _corrupt(where: str, name: str, exc: BaseException) -> ValueError:
    return ValueError(f"{where}: {name} is corrupt or truncated ({type(exc).__name__}: {exc}); expected {_EXPECTED}")


def _pil_name(img: Image.Image) -> str:
    filename = getattr(img, "filename", "") or ""
    return f"file '{filename}'" if filename else "PIL image"
