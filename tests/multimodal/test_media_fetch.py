"""Media fetching limits (mmkit/multimodal/media_fetch.py) without a model: the fetch timeout
bounds the WHOLE download (a trickling body or header is cut off), the byte limit, the pixel
limit checked from the header, the host allow-list and redirects, the allowed local folder, and
the environment defaults (mmkit/envs.py)."""

from __future__ import annotations

import pytest

from media_host import LARGE_PNG, MAX_FETCH, SMALL_PNG, MediaHost, bounded, png_bytes
from mmkit import envs
from mmkit.config import EngineArgs
from mmkit.multimodal.image_io import load_image
from mmkit.multimodal.media_fetch import MediaConnector

TIMEOUT = 1.0
BOUND = TIMEOUT + 15.0  # generous: a loaded 2-core host may be slow, a hang never ends


@pytest.fixture(scope="module")
def host():
    with MediaHost() as served:
        yield served


def refused(fn, *fragments) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("path", ["/trickle.png", "/trickle-headers.png"])
def test_a_trickling_url_times_out_as_a_whole(host, path):
    media = MediaConnector(image_fetch_timeout=TIMEOUT)
    error, elapsed = bounded(lambda: media.load_image(host.url(path), "messages[0].content[1]"), BOUND)
    assert isinstance(error, ValueError), error
    message = str(error)
    assert message.startswith("messages[0].content[1]: ") and path in message
    assert "image fetch timeout of 1 s" in message and "image_fetch_timeout" in message
    assert "MMKIT_IMAGE_FETCH_TIMEOUT" in message
    assert elapsed < BOUND


def test_oversized_downloads_are_refused_naming_the_limit(host):
    media = MediaConnector(max_image_fetch_bytes=MAX_FETCH)
    for path in ("/big.png", "/big-stream.png"):  # announced by Content-Length, or found while reading
        refused(lambda: media.load_image(host.url(path), "x"), f"download limit of {MAX_FETCH} bytes",
                "max_image_fetch_bytes", "MMKIT_MAX_IMAGE_FETCH_BYTES")
    assert media.load_image(host.url("/small.png"), "x").size == (40, 30)


def test_max_image_pixels_is_checked_from_the_header_before_decoding(host, tmp_path):
    media = MediaConnector(max_image_pixels=10_000)
    refused(lambda: media.load_image(host.url("/large.png"), "x"), "300x200", "pixel limit of 10000",
            "max_image_pixels", "MMKIT_MAX_IMAGE_PIXELS")
    # Only the header of a 3000x3000 PNG: the size is refused before anything would decode it
    # (decoding would call it truncated).
    header_only = png_bytes(3000, 3000)[:100]
    refused(lambda: load_image(header_only, where="x", media=media), "3000x3000", "pixel limit of 10000")
    (tmp_path / "large.png").write_bytes(LARGE_PNG)
    refused(lambda: media.load_image(str(tmp_path / "large.png"), "x"), "pixel limit of 10000")
    assert media.load_image(SMALL_PNG, "x").size == (40, 30)


def test_allowed_media_domains(host):
    media = MediaConnector(allowed_media_domains=frozenset({"127.0.0.1"}))
    assert media.load_image(host.url("/small.png"), "x").size == (40, 30)
    assert media.load_image(host.url("/to-small"), "x").size == (40, 30)  # a redirect within the hosts
    refused(lambda: media.load_image(host.url("/to-other-host"), "x"), "'localhost' is not allowed",
            "allowed_media_domains")
    other = MediaConnector(allowed_media_domains=frozenset({"images.example.com"}))
    refused(lambda: other.load_image(host.url("/small.png"), "x"), "'127.0.0.1' is not allowed",
            "images.example.com")
    nothing = MediaConnector(allowed_media_domains=frozenset())
    refused(lambda: nothing.load_image(host.url("/small.png"), "x"), "is not allowed", "(none)")


def test_redirects_can_be_turned_off(host, monkeypatch):
    monkeypatch.setenv("MMKIT_MEDIA_URL_ALLOW_REDIRECTS", "0")
    refused(lambda: MediaConnector().load_image(host.url("/to-small"), "x"), "redirects are off",
            "MMKIT_MEDIA_URL_ALLOW_REDIRECTS=0")


def test_allowed_local_media_path(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "other"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(SMALL_PNG)
    (outside / "b.png").write_bytes(SMALL_PNG)
    (inside / "link.png").symlink_to(outside / "b.png")
    media = MediaConnector(allowed_local_media_path=inside.resolve())
    for ok in (str(inside / "a.png"), (inside / "a.png").as_uri(), inside / "a.png"):
        assert media.load_image(ok, "x").size == (40, 30)
    for bad in (str(outside / "b.png"), (outside / "b.png").as_uri(), str(inside / ".." / "other" / "b.png"),
                str(inside / "link.png")):
        refused(lambda: media.load_image(bad, "x"), "outside the allowed folder", "allowed_local_media_path")
    # The default (LLM.chat's, as before): any local file.
    assert MediaConnector().load_image(str(outside / "b.png"), "x").size == (40, 30)
    closed = MediaConnector(allow_any_local_path=False)
    refused(lambda: closed.load_image(str(inside / "a.png"), "x"), "refused", "allowed_local_media_path")


def test_environment_defaults_and_engine_args(monkeypatch, tmp_path):
    for name in ("MMKIT_IMAGE_FETCH_TIMEOUT", "MMKIT_MAX_IMAGE_FETCH_BYTES", "MMKIT_MAX_IMAGE_PIXELS",
                 "MMKIT_MEDIA_URL_ALLOW_REDIRECTS"):
        monkeypatch.delenv(name, raising=False)
    default = MediaConnector()
    assert (default.image_fetch_timeout, default.max_image_fetch_bytes, default.allow_redirects) == (10.0, 20 << 20, True)
    monkeypatch.setenv("MMKIT_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("MMKIT_MAX_IMAGE_FETCH_BYTES", "1000")
    monkeypatch.setenv("MMKIT_MAX_IMAGE_PIXELS", "500")
    assert envs.MMKIT_IMAGE_FETCH_TIMEOUT == 2.5
    media = MediaConnector.from_engine_args(EngineArgs())
    assert (media.image_fetch_timeout, media.max_image_fetch_bytes, media.max_image_pixels) == (2.5, 1000, 500)
    assert media.allowed_media_domains is None and media.allow_any_local_path
    media = MediaConnector.from_engine_args(EngineArgs(image_fetch_timeout=7, allowed_media_domains=["A.example"],
                                                       allowed_local_media_path=str(tmp_path)))
    assert media.image_fetch_timeout == 7 and media.allowed_media_domains == {"a.example"}
    assert media.allowed_local_media_path == tmp_path.resolve()
    monkeypatch.setenv("MMKIT_IMAGE_FETCH_TIMEOUT", "soon")
    refused(MediaConnector, "MMKIT_IMAGE_FETCH_TIMEOUT", "'soon'")
    monkeypatch.delenv("MMKIT_IMAGE_FETCH_TIMEOUT")
    refused(lambda: MediaConnector.from_engine_args(EngineArgs(image_fetch_timeout=-1)), "image_fetch_timeout")
    refused(lambda: MediaConnector.from_engine_args(EngineArgs(allowed_local_media_path=str(tmp_path / "no"))),
            "allowed_local_media_path", "does not exist")
