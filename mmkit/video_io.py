"""Old import path of `load_video`: `mmkit.multimodal.video_io`."""

from mmkit.multimodal.video_io import load_video

__all__ = ["load_video"]
