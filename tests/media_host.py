"""A local image host for the media-fetching tests: an HTTP server in a thread with routes that
misbehave on purpose (a body or headers that trickle forever, an oversized body, redirects).

    with MediaHost() as host:
        host.url("/small.png")
"""

from __future__ import annotations

import http.server
import io
import threading
import time

import pytest
from PIL import Image

TRICKLE_EVERY_S = 0.2
MAX_FETCH = 200_000  # the byte limit the tests set; /big.png and /big-stream.png exceed it


def png_bytes(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


SMALL_PNG = png_bytes(40, 30)  # 1,200 pixels
LARGE_PNG = png_bytes(300, 200)  # 60,000 pixels: over a 10,000-pixel limit


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # no Content-Length needed: the body ends when the socket closes

    def do_GET(self):  # noqa: N802 - http.server's name
        stop: threading.Event = self.server.stop  # type: ignore[attr-defined]
        port = self.server.server_address[1]
        if self.path == "/trickle.png":  # a byte every 0.2 s, forever (until the client leaves)
            self._start(200, {"Content-Type": "image/png"})
            self._trickle(b"\x89", stop)
        elif self.path == "/trickle-headers.png":  # the headers never end
            self.wfile.write(b"HTTP/1.0 200 OK\r\n")
            self._trickle(b"X-Slow: 1\r\n", stop)
        elif self.path == "/big.png":  # announced by Content-Length
            body = SMALL_PNG + b"\0" * MAX_FETCH
            self._start(200, {"Content-Length": str(len(body))})
            self.wfile.write(body)
        elif self.path == "/big-stream.png":  # no Content-Length: found while reading
            self._start(200, {})
            self.wfile.write(SMALL_PNG + b"\0" * (2 * MAX_FETCH))
        elif self.path in ("/small.png", "/large.png"):
            body = SMALL_PNG if self.path == "/small.png" else LARGE_PNG
            self._start(200, {"Content-Length": str(len(body)), "Content-Type": "image/png"})
            self.wfile.write(body)
        elif self.path == "/to-small":
            self._start(302, {"Location": f"http://127.0.0.1:{port}/small.png"})
        elif self.path == "/to-other-host":
            self._start(302, {"Location": f"http://localhost:{port}/small.png"})
        else:
            self._start(404, {})

    def _start(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _trickle(self, piece: bytes, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.wfile.write(piece)
                self.wfile.flush()
                stop.wait(TRICKLE_EVERY_S)  # the pace of the trickle; ends at once when the test is done
        except OSError:
            pass  # the client hung up: what the tests want

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass


class MediaHost:
    """The server above on 127.0.0.1 and a free port; `stop()` ends every trickle."""

    def __init__(self) -> None:
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.stop = threading.Event()  # type: ignore[attr-defined]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> None:
        self.httpd.stop.set()  # type: ignore[attr-defined]
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "MediaHost":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def bounded(fn, limit_s: float):
    """Run `fn()` in a thread; return (its result or exception, seconds taken). Fails the test if
    it is still running after `limit_s` (a hang is a failure, never a stuck test run)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["value"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - start
    assert not thread.is_alive(), f"still running after {limit_s} s: the fetch timeout did not bound it"
    return box["value"], elapsed


# Fixtures for the test modules that import them (`from media_host import host, media_dir`).
@pytest.fixture(scope="module")
def host():
    """A local media server for the module's tests."""
    with MediaHost() as served:
        yield served


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The allowed local media folder: small.png and large.png."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "small.png").write_bytes(SMALL_PNG)
    (folder / "large.png").write_bytes(LARGE_PNG)
    return folder
