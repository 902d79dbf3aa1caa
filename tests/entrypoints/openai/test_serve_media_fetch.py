"""`mmkit serve`'s media flags (--image-fetch-timeout, --max-image-fetch-bytes, --max-image-pixels,
--allowed-local-media-path, --allowed-media-domains): a trickling URL is a 400 naming the timeout
within the timeout plus a margin, never a hang; every other refusal is a 400 naming its limit."""

from __future__ import annotations

import time

import httpx
import pytest

from media_host import MAX_FETCH, SMALL_PNG, host, media_dir  # noqa: F401 - fixtures
from serve_utils import ServerProcess

TIMEOUT = 1.5
BOUND = TIMEOUT + 15.0


@pytest.fixture(scope="module")
def server(media_dir):
    # The flags win over the environment's defaults (set here to other values on purpose).
    proc = ServerProcess("--served-model-name", "mm", "--image-fetch-timeout", str(TIMEOUT),
                         "--max-image-fetch-bytes", str(MAX_FETCH), "--max-image-pixels", "10000",
                         "--allowed-local-media-path", str(media_dir), "--allowed-media-domains", "127.0.0.1",
                         env={"MMKIT_IMAGE_FETCH_TIMEOUT": "60", "MMKIT_MAX_IMAGE_FETCH_BYTES": "999999999"})
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


def post_image(server, url):
    body = {"model": "mm", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
    start = time.monotonic()
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=BOUND + 30)
    return response, time.monotonic() - start


def error_400(response, *fragments):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0]", error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def test_trickling_url_is_a_400_naming_the_timeout(server, host):
    response, elapsed = post_image(server, host.url("/trickle.png"))
    error_400(response, "image fetch timeout of 1.5 s (--image-fetch-timeout, env MMKIT_IMAGE_FETCH_TIMEOUT)")
    assert elapsed < BOUND
    response, _ = post_image(server, host.url("/trickle-headers.png"))
    error_400(response, "image fetch timeout of 1.5 s")
    assert post_image(server, host.url("/small.png"))[0].status_code == 200  # the server still serves


def test_limits_and_allow_lists_are_400s(server, host, media_dir, tmp_path):
    error_400(post_image(server, host.url("/big.png"))[0], f"download limit of {MAX_FETCH} bytes",
              "--max-image-fetch-bytes")
    error_400(post_image(server, host.url("/big-stream.png"))[0], f"download limit of {MAX_FETCH} bytes")
    error_400(post_image(server, host.url("/large.png"))[0], "pixel limit of 10000", "--max-image-pixels")
    error_400(post_image(server, str(media_dir / "large.png"))[0], "pixel limit of 10000")
    error_400(post_image(server, host.url("/to-other-host"))[0], "'localhost' is not allowed",
              "--allowed-media-domains")
    outside = tmp_path / "outside.png"
    outside.write_bytes(SMALL_PNG)
    error_400(post_image(server, outside.as_uri())[0], "outside the allowed folder", "--allowed-local-media-path")
    for url in (host.url("/small.png"), host.url("/to-small"), str(media_dir / "small.png")):
        assert post_image(server, url)[0].status_code == 200, url
