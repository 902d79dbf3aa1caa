"""Old import path of `load_image`: `mmkit.multimodal.image_io` (documented in the README)."""

from mmkit.multimodal.image_io import HTTP_TIMEOUT_S, MAX_IMAGE_BYTES, ImageSource, load_image, load_image_bytes

__all__ = ["load_image", "load_image_bytes", "ImageSource", "HTTP_TIMEOUT_S", "MAX_IMAGE_BYTES"]
