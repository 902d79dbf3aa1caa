"""LLM.chat under the media options (EngineArgs: image_fetch_timeout, max_image_fetch_bytes,
max_image_pixels, allowed_local_media_path, allowed_media_domains): each refusal is a ValueError
naming the part and the limit, raised before any request is added; a trickling URL never hangs."""

from __future__ import annotations

import pytest

from conftest import get_llm
from media_host import LARGE_PNG, MAX_FETCH, SMALL_PNG, bounded, host, media_dir  # noqa: F401 - fixtures
from mmkit import SamplingParams

TIMEOUT = 1.0
BOUND = TIMEOUT + 15.0
GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(tiny_ckpt, media_dir):
    return get_llm(tiny_ckpt, image_fetch_timeout=TIMEOUT, max_image_fetch_bytes=MAX_FETCH, max_image_pixels=10_000,
                   allowed_local_media_path=str(media_dir), allowed_media_domains=("127.0.0.1",))


def ask(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]


def chat_error(llm, url, *fragments):
    with pytest.raises(ValueError) as info:
        llm.chat(ask(url), GREEDY, use_tqdm=False)
    message = str(info.value)
    assert message.startswith("messages[0][0].content[0]: "), message
    for fragment in fragments:
        assert fragment in message, message
    assert not llm.llm_engine.has_unfinished_requests()


def test_allowed_sources_work(llm, host, media_dir):
    for url in (host.url("/small.png"), host.url("/to-small"), str(media_dir / "small.png"),
                (media_dir / "small.png").as_uri()):
        out = llm.chat(ask(url), GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2, url


def test_a_trickling_url_times_out(llm, host):
    error, elapsed = bounded(lambda: llm.chat(ask(host.url("/trickle.png")), GREEDY, use_tqdm=False), BOUND)
    assert isinstance(error, ValueError), error
    assert "image fetch timeout of 1 s (image_fetch_timeout, env MMKIT_IMAGE_FETCH_TIMEOUT)" in str(error)
    assert elapsed < BOUND
    assert llm.chat(ask(host.url("/small.png")), GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still works


def test_limits_and_allow_lists_refuse(llm, host, media_dir, tmp_path):
    chat_error(llm, host.url("/big.png"), f"download limit of {MAX_FETCH} bytes", "max_image_fetch_bytes")
    chat_error(llm, host.url("/large.png"), "300x200", "pixel limit of 10000", "max_image_pixels")
    chat_error(llm, host.url("/to-other-host"), "'localhost' is not allowed", "allowed_media_domains")
    chat_error(llm, "http://example.invalid/x.png", "'example.invalid' is not allowed")
    outside = tmp_path / "outside.png"
    outside.write_bytes(SMALL_PNG)
    for url in (str(outside), outside.as_uri(), str(media_dir / ".." / outside.parent.name / "outside.png")):
        chat_error(llm, url, "outside the allowed folder", "allowed_local_media_path")
    (media_dir / "large.png").write_bytes(LARGE_PNG)
    chat_error(llm, str(media_dir / "large.png"), "pixel limit of 10000")


def test_a_bad_media_option_fails_before_the_model_loads(tiny_ckpt, tmp_path):
    from mmkit import LLM

    with pytest.raises(ValueError, match="allowed_local_media_path: .* is not a folder"):
        LLM(str(tiny_ckpt), allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_image_fetch_bytes: got 0"):
        LLM(str(tiny_ckpt), max_image_fetch_bytes=0)
