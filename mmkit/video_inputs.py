"""Old import path of `parse_videos`: `mmkit.multimodal.video`."""

from mmkit.multimodal.video import parse_videos

__all__ = ["parse_videos"]
