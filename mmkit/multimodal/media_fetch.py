"""Where media may come from and how long a download may take (vLLM's `MediaConnector`).

One frozen `MediaConnector` holds the rules `LLM.chat` and `mmkit serve` load images under:

- `allowed_local_media_path`: local paths and `file://` URLs are read only from under this
  folder (symlinks and `..` resolved first). Unset: `LLM.chat` reads any local file (as it
  always has), the server none (`allow_any_local_path` says which).
- `allowed_media_domains`: when set, http(s) URLs (and every redirect they take) must name one
  of these hosts exactly. Unset: `LLM.chat` fetches from any host; the server's default is none.
- `image_fetch_timeout`: seconds the WHOLE download may take, not each read: a server that
  trickles its body is cut off at the deadline (checked between reads, the socket's timeout is
  the time left, and a watchdog hangs up a connection still open at the deadline, so headers
  that trickle are cut off too).
- `max_image_fetch_bytes`: the largest body accepted from a URL (a larger Content-Length is
  refused before reading).
- `max_image_pixels`: width x height of a loaded image, read from its header before decoding.
- `allow_redirects`: whether a URL may redirect (`MMKIT_MEDIA_URL_ALLOW_REDIRECTS`).

Limits left unset take their defaults from the environment (`mmkit/envs.py`). Every refusal is
a `ValueError` naming the message part (`where`) and the option that refused it; the server
answers it with a 400. Loading itself is `mmkit.multimodal.image_io.load_image(..., media=...)`.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from mmkit import envs
from mmkit.multimodal.items import MAX_IMAGE_PIXELS

_CHUNK = 64 << 10
_ENV = {"image_fetch_timeout": "MMKIT_IMAGE_FETCH_TIMEOUT", "max_image_fetch_bytes": "MMKIT_MAX_IMAGE_FETCH_BYTES",
        "max_image_pixels": "MMKIT_MAX_IMAGE_PIXELS"}

__all__ = ["MediaConnector", "parse_domains"]


@dataclass(frozen=True)
class MediaConnector:
    """What may be opened and the limits of a download; built once (`from_engine_args`)."""

    allowed_local_media_path: Path | None = None
    # With no allowed_local_media_path: True reads any local file (LLM.chat), False none (server).
    allow_any_local_path: bool = True
    # None: any host; a set (maybe empty): only these hosts.
    allowed_media_domains: frozenset[str] | None = None
    # None: the environment's default (mmkit/envs.py), resolved at construction.
    image_fetch_timeout: float | None = None
    max_image_fetch_bytes: int | None = None
    max_image_pixels: int | None = None
    allow_redirects: bool | None = None
    # How errors name the options: "engine" (image_fetch_timeout) or "server" (--image-fetch-timeout).
    option_style: str = "engine"

    def __post_init__(self) -> None:
        defaults = {"image_fetch_timeout": envs.MMKIT_IMAGE_FETCH_TIMEOUT,
                    "max_image_fetch_bytes": envs.MMKIT_MAX_IMAGE_FETCH_BYTES,
                    "max_image_pixels": envs.MMKIT_MAX_IMAGE_PIXELS,
                    "allow_redirects": envs.MMKIT_MEDIA_URL_ALLOW_REDIRECTS}
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        _check_positive(self.option("image_fetch_timeout"), self.image_fetch_timeout, number=float)
        _check_positive(self.option("max_image_fetch_bytes"), self.max_image_fetch_bytes)
        _check_positive(self.option("max_image_pixels"), self.max_image_pixels, upper=MAX_IMAGE_PIXELS)

    @classmethod
    def from_engine_args(cls, args: Any) -> "MediaConnector":
        """`LLM.chat`'s connector from `EngineArgs` (unset fields: environment defaults)."""
        return cls(allowed_local_media_path=check_media_folder(args.allowed_local_media_path,
                                                               "allowed_local_media_path"),
                   allow_any_local_path=True,
                   allowed_media_domains=parse_domains(args.allowed_media_domains, "allowed_media_domains"),
                   image_fetch_timeout=args.image_fetch_timeout, max_image_fetch_bytes=args.max_image_fetch_bytes,
                   max_image_pixels=args.max_image_pixels)

    def replace(self, **changes: Any) -> "MediaConnector":
        return dataclasses.replace(self, **changes)

    def option(self, name: str) -> str:
        """An option as the user sets it: `image_fetch_timeout` or `--image-fetch-timeout`."""
        return "--" + name.replace("_", "-") if self.option_style == "server" else name

    def limit(self, name: str) -> str:
        """`(image_fetch_timeout, env MMKIT_IMAGE_FETCH_TIMEOUT)`: where a limit is set, for errors."""
        return f"({self.option(name)}, env {_ENV[name]})"

    # ------------------------------------------------------------------ loading
    def load_image(self, source: Any, where: str):
        """One image source (URL, data URI, path, bytes, PIL image) -> a decoded PIL image."""
        from mmkit.multimodal.image_io import load_image

        return load_image(source, where=where, media=self)

    # ------------------------------------------------------------------ local files
    def check_local_path(self, path: Path, shown: str, where: str) -> Path:
        """The path to open, or a `ValueError` when it is outside `allowed_local_media_path`."""
        shown = shown[:200]
        if self.allowed_local_media_path is None:
            if self.allow_any_local_path:
                return path
            how = ("when started with --allowed-local-media-path" if self.option_style == "server"
                   else "under allowed_local_media_path")
            raise ValueError(f"{where}: local file {shown!r} refused; local files are read only {how}")
        resolved = path.expanduser().resolve()  # symlinks and '..' resolved before the check
        if not resolved.is_relative_to(self.allowed_local_media_path):
            sep = " " if self.option_style == "server" else "="
            raise ValueError(f"{where}: local file {shown!r} is outside the allowed folder "
                             f"{self.option('allowed_local_media_path')}{sep}{str(self.allowed_local_media_path)!r}")
        return resolved

    # ------------------------------------------------------------------ http(s)
    def check_url(self, url: str, where: str) -> None:
        """http(s) only, and from an allowed host when `allowed_media_domains` is set."""
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme.lower() not in ("http", "https"):
            raise ValueError(f"{where}: URL '{url[:200]}' has scheme {parsed.scheme!r}; expected http(s)")
        if self.allowed_media_domains is None:
            return
        host = (parsed.hostname or "").lower()
        if host not in self.allowed_media_domains:
            allowed = ",".join(sorted(self.allowed_media_domains)) or "none"
            raise ValueError(f"{where}: image host {host!r} is not allowed; expected one of "
                             f"{self.option('allowed_media_domains')} ({allowed})")

    def fetch(self, url: str, where: str) -> bytes:
        """The body of an http(s) URL, within the timeout and size limits, or a `ValueError`."""
        self.check_url(url, where)
        return _Download(self, url, where).run()


class _Download:
    """One fetch under a deadline: every socket it opens is hung up when the deadline passes."""

    def __init__(self, media: MediaConnector, url: str, where: str) -> None:
        self.media, self.url, self.where = media, url, where
        self.name = f"URL '{url[:200]}'"
        self.deadline = time.monotonic() + media.image_fetch_timeout
        self.sockets: list[socket.socket] = []
        self.timed_out = threading.Event()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> bytes:
        watchdog = threading.Timer(max(self.remaining(), 0.0), self._hang_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            body = self._read()
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{self.where}: {self.name} answered HTTP {exc.code} {exc.reason}; "
                             "expected an image") from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, DNS, timeouts
            if self._is_timeout(exc):
                raise self._timeout_error() from exc
            reason = getattr(exc, "reason", None) or exc
            raise ValueError(f"{self.where}: {self.name} could not be downloaded ({reason}); "
                             "expected a reachable image URL") from exc
        finally:
            watchdog.cancel()
        if self.timed_out.is_set():  # the watchdog's hang-up reads like the end of the body
            raise self._timeout_error()
        return body

    def _read(self) -> bytes:
        max_bytes = self.media.max_image_fetch_bytes
        opener = urllib.request.build_opener(*self._handlers())
        request = urllib.request.Request(self.url, headers={"User-Agent": "mmkit", "Accept": "image/*"})
        with opener.open(request, timeout=max(self.remaining(), 0.001)) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise self._too_big(f"announces {int(length)} bytes")
            chunks, size = [], 0
            while True:
                left = self.remaining()
                if left <= 0 or self.timed_out.is_set():
                    raise self._timeout_error()
                for sock in self.sockets[-1:]:
                    sock.settimeout(left)  # a silent server: the read ends at the deadline
                chunk = response.read1(_CHUNK)  # returns what arrived: a trickle cannot hold it
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise self._too_big("is larger than that")
                chunks.append(chunk)
        return b"".join(chunks)

    def _handlers(self) -> list[urllib.request.BaseHandler]:
        sockets = self.sockets

        class _Recorded(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                sockets.append(self.sock)

        class _RecordedTLS(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                sockets.append(self.sock)

        class _HTTP(urllib.request.HTTPHandler):
            def http_open(self, req):
                return self.do_open(_Recorded, req)

        class _HTTPS(urllib.request.HTTPSHandler):
            def https_open(self, req):
                extra = {"check_hostname": self._check_hostname} if hasattr(self, "_check_hostname") else {}
                return self.do_open(_RecordedTLS, req, context=self._context, **extra)

        download = self

        class _Redirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if not download.media.allow_redirects:
                    raise ValueError(f"{download.where}: {download.name} redirects (HTTP {code}) to "
                                     f"'{newurl[:200]}'; redirects are off (MMKIT_MEDIA_URL_ALLOW_REDIRECTS=0)")
                download.media.check_url(newurl, download.where)  # a redirect may not leave the allowed hosts
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        return [_HTTP(), _HTTPS(), _Redirects()]

    def _hang_up(self) -> None:
        self.timed_out.set()
        for sock in list(self.sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in another thread
            except OSError:
                pass

    def _is_timeout(self, exc: BaseException) -> bool:
        reason = getattr(exc, "reason", exc)
        return self.timed_out.is_set() or self.remaining() <= 0 or isinstance(reason, (socket.timeout, TimeoutError))

    def _timeout_error(self) -> ValueError:
        return ValueError(f"{self.where}: {self.name} did not finish downloading within the image fetch timeout of "
                          f"{self.media.image_fetch_timeout:g} s {self.media.limit('image_fetch_timeout')}; "
                          "expected a faster image URL")

    def _too_big(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: {self.name} {what}, over the download limit of "
                          f"{self.media.max_image_fetch_bytes} bytes {self.media.limit('max_image_fetch_bytes')}; "
                          "expected a smaller image")


# ---------------------------------------------------------------------- option parsing
def parse_domains(domains: str | Iterable[str] | None, option: str) -> frozenset[str] | None:
    """`"a.com, b.com"` or `["a.com", "b.com"]` -> {"a.com", "b.com"}; None stays None (any host)."""
    if domains is None:
        return None
    if isinstance(domains, str):
        domains = domains.split(",")
    try:
        values = [d.strip().lower() for value in domains for d in value.split(",")]
    except (TypeError, AttributeError):
        raise TypeError(f"{option}: got {domains!r:.80}; expected a list of host names like "
                        "['images.example.com']") from None
    return frozenset(v for v in values if v)


def check_media_folder(path: str | os.PathLike | None, option: str) -> Path | None:
    """An existing folder, resolved; None stays None."""
    if path is None or path == "":
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{option}: got {type(path).__name__}; expected a folder path")
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"{option}: {str(folder)!r} is not a folder"
                         + (" (it does not exist)" if not folder.exists() else ""))
    return folder


def _check_positive(option: str, value: Any, number: type = int, upper: int | None = None) -> None:
    ok_type = isinstance(value, (int, float)) if number is float else isinstance(value, int)
    if isinstance(value, bool) or not ok_type or not value > 0 or value == float("inf") \
            or (upper is not None and value > upper):
        what = "a positive number of seconds" if number is float else "a positive integer"
        bound = f" at most {upper}" if upper is not None else ""
        raise ValueError(f"{option}: got {value!r}; expected {what}{bound}")
