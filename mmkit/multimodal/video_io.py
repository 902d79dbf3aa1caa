"""Read a video file for `LLM.chat`'s `video_url` parts with PyAV (every frame, RGB).

(transformers' `load_video` is not used: its PyAV path needs the container's frame count,
which Matroska/WebM files do not store.)

Decoding needs a video reader the ecosystem already uses: PyAV (`pip install av`, or
`pip install -e ".[video]"` from a clone). Without it a `video_url` that names a file is a clear error;
a list of frames (PIL images, paths or image URLs) needs no reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmkit.multimodal.image_io import load_image
from mmkit.multimodal.media_fetch import MediaConnector


def load_video(source: Any, *, where: str, media: MediaConnector | None = None) -> Any:
    """A local video file (path or `file://` URL) -> (T, C, H, W) uint8 tensor; a list of frames
    (PIL images, paths, file:// or data: URLs) -> a list of PIL frames. `media`: the allowed local
    folder and the image limits (mmkit/multimodal/media_fetch.py; default: any local file)."""
    media = media if media is not None else MediaConnector()
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError(f"{where}: got an empty list of frames; expected at least one frame")
        return [load_image(frame, where=f"{where}[{i}]", media=media) for i, frame in enumerate(source)]
    if not isinstance(source, (str, Path)):
        raise TypeError(f"{where}: got {type(source).__name__}; expected a video file path, a file:// URL or "
                        "a list of frames")
    path = str(source)
    if path.startswith("file://"):
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(path).path)
    if "://" in path:
        raise ValueError(f"{where}: got {path!r}; expected a local video file or a list of frames (mmkit does "
                         "not download videos)")
    path = str(media.check_local_path(Path(path), str(source), where))
    if not Path(path).is_file():
        raise ValueError(f"{where}: video file {path!r} does not exist")
    try:
        import av
    except ImportError:
        raise ValueError(f"{where}: reading the video file {path!r} needs PyAV; install it with `pip install av` "
                         "(or `pip install -e \".[video]\"` from a clone), or pass the frames as a list of images") from None
    try:
        with av.open(path) as container:
            frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    except Exception as exc:  # noqa: BLE001 - any decoder failure names the input
        raise ValueError(f"{where}: video file {path!r} could not be decoded ({type(exc).__name__}: {exc})") from exc
    if not frames:
        raise ValueError(f"{where}: video file {path!r} has no frames")
    return torch.stack(frames).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
