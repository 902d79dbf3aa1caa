"""Where the server may read images from: data URIs always; local files only under
`--allowed-local-media-path`; http(s) only from `--allowed-media-domains`.

`MediaPolicy` is the server's `MediaConnector` (mmkit/multimodal/media_fetch.py): the same
loader and limits as `LLM.chat`, with the server's closed defaults (no local files, no hosts)
and errors that name the flags. Every refusal and every failure is a `ValueError` naming the
message part (`where`), so the server answers 400. Downloads follow redirects only to allowed
hosts, stop at `--max-image-fetch-bytes` and give up after `--image-fetch-timeout` seconds in
total (defaults from MMKIT_MAX_IMAGE_FETCH_BYTES and MMKIT_IMAGE_FETCH_TIMEOUT).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from mmkit.multimodal.media_fetch import MediaConnector, check_media_folder, parse_domains


@dataclass(frozen=True)
class MediaPolicy(MediaConnector):
    """What the server may open; frozen and built once from the command line."""

    allow_any_local_path: bool = False
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    option_style: str = "server"

    @classmethod
    def from_args(cls, allowed_local_media_path: str | None, allowed_media_domains: str | list[str] | None, *,
                  image_fetch_timeout: float | None = None, max_image_fetch_bytes: int | None = None,
                  max_image_pixels: int | None = None) -> "MediaPolicy":
        """From `mmkit serve`'s flags; a limit left None takes the environment's default."""
        return cls(allowed_local_media_path=check_media_folder(allowed_local_media_path,
                                                               "--allowed-local-media-path"),
                   allowed_media_domains=parse_domains(allowed_media_domains or [], "--allowed-media-domains"),
                   image_fetch_timeout=image_fetch_timeout, max_image_fetch_bytes=max_image_fetch_bytes,
                   max_image_pixels=max_image_pixels)

    def load(self, url: str, where: str) -> Image.Image:
        """One `image_url` -> a decoded PIL image, or a `ValueError` naming `where`."""
        return self.load_image(url, where)
