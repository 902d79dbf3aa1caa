"""Video inputs: a list of PIL frames or a (T, C, H, W) tensor per video, validated up front.

Frames follow the image rules (uint8 0-255, or float 0-1 converted with round(x * 255)); each
frame becomes an `ImageItem`, so hashing and conversion are shared with images.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.parse import parse_images


def parse_videos(where: str, data: Any) -> list[list[ImageItem]]:
    """One video (a list of PIL frames or a 4-D tensor) or a list of videos -> frames per video."""
    if isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple)) and data
                                          and isinstance(data[0], Image.Image)):
        return [_parse_video(where, data)]
    if isinstance(data, (list, tuple)) and data:
        return [_parse_video(f"{where}[{i}]", v) for i, v in enumerate(data)]
    raise TypeError(f"{where}: got {_describe(data)}; expected a video as a list of PIL frames or a (T, C, H, W) "
                    "uint8/float tensor, or a list of such videos")


def _parse_video(where: str, video: Any) -> list[ImageItem]:
    if isinstance(video, torch.Tensor):
        if video.dim() != 4:
            raise ValueError(f"{where}: got a video tensor of shape {tuple(video.shape)}; expected (T, C, H, W) "
                             "frames with C = 1 or 3")
        frames = parse_images(where, video)
    elif isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
        frames = parse_images(where, list(video))
    else:
        raise TypeError(f"{where}: got {_describe(video)}; expected a list of PIL frames or a (T, C, H, W) tensor")
    sizes = {(f.width, f.height) for f in frames}
    if len(sizes) > 1:
        raise ValueError(f"{where}: frames of different sizes {sorted(sizes)}; expected every frame of a video "
                         "to have the same size")
    return frames


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = type(value[0]).__name__ if value else "nothing"
        return f"a {type(value).__name__} of {len(value)} ({inner})"
    return type(value).__name__
