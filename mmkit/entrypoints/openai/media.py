"""Where the server may read images from: data URIs always; local files only under
`--allowed-local-media-path`; http(s) only from `--allowed-media-domains`.

Every refusal and every failure is a `ValueError` naming the message part (`where`), so the
server answers 400. Downloads follow redirects only to allowed hosts, stop at
`max_bytes` and give up after `timeout` seconds in total.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mmkit.multimodal.image_io import load_image, load_image_bytes

#: Seconds a whole image download may take (env `MMKIT_IMAGE_FETCH_TIMEOUT`).
DEFAULT_FETCH_TIMEOUT_S = float(os.environ.get("MMKIT_IMAGE_FETCH_TIMEOUT", "10"))
#: The largest image accepted from a URL (env `MMKIT_MAX_IMAGE_FETCH_BYTES`).
DEFAULT_MAX_FETCH_BYTES = int(os.environ.get("MMKIT_MAX_IMAGE_FETCH_BYTES", str(20 << 20)))
_CHUNK = 64 << 10


@dataclass(frozen=True)
class MediaPolicy:
    """What the server may open; frozen and built once from the command line."""

    allowed_local_media_path: Path | None = None
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES

    @classmethod
    def from_args(cls, allowed_local_media_path: str | None, allowed_media_domains: str | list[str] | None,
                  ) -> "MediaPolicy":
        local = None
        if allowed_local_media_path:
            local = Path(allowed_local_media_path).expanduser().resolve()
            if not local.is_dir():
                raise ValueError(f"--allowed-local-media-path: {str(local)!r} is not a folder")
        domains = allowed_media_domains or []
        if isinstance(domains, str):
            domains = domains.split(",")
        return cls(local, frozenset(d.strip().lower() for d in domains if d.strip()))

    def load(self, url: str, where: str) -> Image.Image:
        """One `image_url` -> a decoded PIL image, or a `ValueError` naming `where`."""
        lowered = url[:16].lower()
        if lowered.startswith("data:"):
            return load_image(url, where=where)
        if lowered.startswith(("http://", "https://")):
            return self._load_http(url, where)
        if lowered.startswith("file:"):
            parsed = urllib.parse.urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"{where}: got file URL on host {parsed.netloc!r}; expected file:///path")
            return self._load_local(Path(urllib.request.url2pathname(parsed.path)), url, where)
        if "://" in url[:16]:
            scheme = url.split("://", 1)[0]
            raise ValueError(f"{where}: got a URL with scheme {scheme!r}; expected a data:image/...;base64 URI, "
                             "http(s):// or file://")
        return self._load_local(Path(url), url, where)

    # ------------------------------------------------------------------ local files
    def _load_local(self, path: Path, shown: str, where: str) -> Image.Image:
        if self.allowed_local_media_path is None:
            raise ValueError(f"{where}: local image {shown[:200]!r} refused; the server reads local files "
                             "only when started with --allowed-local-media-path")
        resolved = path.expanduser().resolve()  # symlinks and '..' resolved before the check
        if not resolved.is_relative_to(self.allowed_local_media_path):
            raise ValueError(f"{where}: local image {shown[:200]!r} is outside the allowed folder "
                             f"--allowed-local-media-path {str(self.allowed_local_media_path)!r}")
        return load_image(resolved, where=where)

    # ------------------------------------------------------------------ http(s)
    def _check_host(self, url: str, where: str) -> None:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in self.allowed_media_domains:
            allowed = ",".join(sorted(self.allowed_media_domains)) or "none"
            raise ValueError(f"{where}: image host {host!r} is not allowed; expected one of "
                             f"--allowed-media-domains ({allowed})")

    def _load_http(self, url: str, where: str) -> Image.Image:
        self._check_host(url, where)
        policy = self

        class _Redirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, req, fp, code, msg, headers, newurl):
                policy._check_host(newurl, where)  # a redirect may not leave the allowed hosts
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        opener = urllib.request.build_opener(_Redirects)
        deadline = time.monotonic() + self.fetch_timeout_s
        name = f"URL '{url[:200]}'"
        try:
            with opener.open(url, timeout=self.fetch_timeout_s) as response:
                chunks, size = [], 0
                while True:
                    if time.monotonic() > deadline:
                        raise ValueError(f"{where}: {name} took longer than {self.fetch_timeout_s:g} s to download")
                    chunk = response.read(_CHUNK)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_fetch_bytes:
                        raise ValueError(f"{where}: {name} is larger than {self.max_fetch_bytes} bytes; "
                                         "expected a smaller image")
                    chunks.append(chunk)
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{where}: {name} answered HTTP {exc.code} {exc.reason}; expected an image") from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, DNS, timeouts
            reason = getattr(exc, "reason", exc)
            raise ValueError(f"{where}: {name} could not be downloaded ({reason})") from exc
        return load_image_bytes(b"".join(chunks), where=where, name=name)
