"""The playground page of `mmkit serve`, driven in a real headless Chromium through Playwright.

Each test runs against a real `mmkit serve` subprocess with the embedded model (tests/ui_harness.py).
Without a browser these tests skip with the reason; MMKIT_REQUIRE_BROWSER=1 (set by .ci/run)
turns that into a failure.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
import zlib

import pytest

from serve_utils import ServerProcess, data_uri, scrape
from ui_harness import (RED_CIRCLE, SCREENSHOT_SIZE, ask, browser_missing_reason, capture_conversation, launch_chromium,
                        start_server, wait_connected)

QUESTION = "What color is the circle?"
API_KEY = "sesame-4711"


def _require_browser() -> None:
    reason = browser_missing_reason()
    if reason is None:
        return
    if os.environ.get("MMKIT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"MMKIT_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(browser):
    server = start_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_server(browser):
    """A server whose engine steps take 25 ms more each: a 400-token answer lasts 10 s, so a
    click can land mid-answer however fast the machine (the plain one finishes in about a second)."""
    server = start_server(step_delay_s=0.025)
    yield server
    server.stop()


@pytest.fixture
def page(browser):
    """A fresh tab (own sessionStorage); fails the test on any uncaught JavaScript error."""
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
    page.chat_requests = []
    page.on("request", lambda r: page.chat_requests.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") else None)
    yield page
    context.close()
    assert page.js_errors == [], page.js_errors


def _openai(server: ServerProcess, api_key: str = "unused"):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0)


def _greedy_api_answer(server: ServerProcess, body: dict) -> tuple[str, int]:
    """The API's own non-streamed answer for the body the page sent: (text, completion tokens)."""
    out = _openai(server).chat.completions.create(
        model=body["model"], messages=body["messages"], temperature=body["temperature"],
        max_tokens=body["max_tokens"])
    return out.choices[0].message.content, out.usage.completion_tokens


def _metric(server: ServerProcess, name: str) -> float:
    values = scrape(server.url)
    matches = [v for k, v in values.items() if k in (name, name + "_total")]
    assert matches, f"{name} not in /metrics: {sorted(values)}"
    return matches[0]


def test_page_is_self_contained_labelled_and_fits_a_narrow_window(server, page):
    origins = set()
    page.on("request", lambda r: origins.add(r.url.split("/")[2]) if "://" in r.url[:10] else None)
    page.goto(server.url + "/")
    wait_connected(page)
    assert origins == {server.url.split("/")[2]}, origins  # no CDN, fonts or other hosts

    for testid in ("image-input", "prompt", "send", "new-chat", "temperature", "max-tokens"):
        assert page.get_by_test_id(testid).count() == 1, testid
    assert page.get_by_test_id("stop").is_hidden()
    assert page.get_by_test_id("error").is_hidden()
    assert page.get_by_test_id("api-key").count() == 0  # no key needed on this server
    assert page.get_by_test_id("assistant-message").count() == 0

    # Every control has a label (a <label for>) or a visible name.
    assert page.get_by_label("Question", exact=True).get_attribute("data-testid") == "prompt"
    assert page.get_by_label("Temperature", exact=True).get_attribute("data-testid") == "temperature"
    assert page.get_by_label("Max tokens", exact=True).get_attribute("data-testid") == "max-tokens"
    assert page.get_by_label("Add image", exact=True).get_attribute("data-testid") == "image-input"
    for name, testid in (("Send", "send"), ("New chat", "new-chat")):
        assert page.get_by_role("button", name=name).get_attribute("data-testid") == testid

    # Keyboard: the question box has the focus; Shift+Enter is a new line, not a send.
    assert page.evaluate("document.activeElement.dataset.testid") == "prompt"
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.get_by_test_id("prompt").input_value() == "first line\nsecond line"
    assert page.get_by_test_id("assistant-message").count() == 0 and page.chat_requests == []
    # Tab reaches the send button from the question box.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.testid") == "send"

    # A phone-sized window: nothing wider than the window, the controls stay on screen.
    page.set_viewport_size({"width": 360, "height": 640})
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    for testid in ("prompt", "send", "temperature", "max-tokens", "new-chat"):
        box = page.get_by_test_id(testid).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 360 and box["width"] > 30, (testid, box)


def test_red_circle_streams_the_api_greedy_answer_and_keeps_the_image(server, page):
    page.goto(server.url + "/")
    wait_connected(page)
    # A setting the API would refuse is caught on the page, before any request.
    page.get_by_test_id("temperature").fill("-1")
    page.get_by_test_id("prompt").fill(QUESTION)
    page.get_by_test_id("send").click()
    assert "Temperature must be" in page.get_by_test_id("error").text_content()
    assert page.chat_requests == []
    page.get_by_test_id("temperature").fill("0")
    page.get_by_test_id("max-tokens").fill("32")
    answer = ask(page, QUESTION, RED_CIRCLE, press_enter=True)
    assert "red" in answer

    body = page.chat_requests[-1]
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 32
    expected_messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(RED_CIRCLE)}},
        {"type": "text", "text": QUESTION}]}]
    assert body["messages"] == expected_messages
    api_text, api_tokens = _greedy_api_answer(server, body)
    assert answer == api_text

    stats = page.get_by_test_id("stats").last
    assert int(stats.get_attribute("data-tokens")) == api_tokens > 0
    assert f"{api_tokens} token" in stats.text_content() and "TTFT" in stats.text_content()
    assert float(stats.get_attribute("data-ttft-ms")) >= 0
    assert float(stats.get_attribute("data-tokens-per-second")) > 0

    # A follow-up without a new image: the first turn's image is still sent, and the answer
    # streams in one piece per token (one text-node append per server chunk).
    page.evaluate("""() => {
        window.__appends = 0;
        new MutationObserver((records) => { window.__appends += records.length; })
            .observe(document.getElementById('transcript'), {characterData: true, subtree: true});
    }""")
    follow_up = ask(page, "Describe the image.")
    body = page.chat_requests[-1]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][0] == expected_messages[0] and body["messages"][1]["content"] == answer
    api_text, api_tokens = _greedy_api_answer(server, body)
    assert follow_up == api_text and "red circle" in follow_up
    without_image = [{"role": "user", "content": QUESTION}, *body["messages"][1:]]
    assert _greedy_api_answer(server, {**body, "messages": without_image})[0] != follow_up
    assert page.evaluate("window.__appends") >= 2 and api_tokens >= 3
    assert page.get_by_test_id("assistant-message").count() == 2
    assert page.get_by_test_id("stats").count() == 2

    # New chat: an empty page, and the next question starts a new conversation.
    page.get_by_test_id("new-chat").click()
    assert page.get_by_test_id("assistant-message").count() == 0
    assert "red" in ask(page, QUESTION, RED_CIRCLE)
    assert len(page.chat_requests[-1]["messages"]) == 1


def test_stop_ends_the_stream_and_the_server_aborts_the_request(slow_server, page):
    server = slow_server
    max_tokens = 400  # the prompt is 77 tokens; the model's context is 512

    # The embedded model answers in a few tokens; `ignore_eos` (a vLLM extra the server takes)
    # makes this one answer long. Added on the way out: the page itself sends plain OpenAI bodies.
    def long_answer(route):
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/chat/completions", long_answer)
    page.goto(server.url + "/")
    wait_connected(page)
    page.get_by_test_id("max-tokens").fill(str(max_tokens))
    generated_before = _metric(server, "mmkit:generation_tokens")
    page.get_by_test_id("image-input").set_input_files(str(RED_CIRCLE))
    page.get_by_test_id("prompt").fill("Describe the image.")
    page.get_by_test_id("send").click()
    message = page.get_by_test_id("assistant-message").last
    page.wait_for_function("document.querySelector('[data-testid=assistant-message]').textContent.length > 0",
                           polling="raf")
    page.get_by_test_id("stop").click()

    page.get_by_test_id("send").wait_for(state="visible")
    assert page.get_by_test_id("stop").is_hidden()
    stats = page.get_by_test_id("stats").last
    assert "stopped" in stats.text_content()
    shown = message.text_content()
    assert int(stats.get_attribute("data-tokens")) < max_tokens

    # Bounded polling, not a fixed delay: the bound only catches a request that never stops
    # (the token counts below show it stopped early).
    deadline = time.monotonic() + 60
    while _metric(server, "mmkit:num_requests_running") != 0:
        assert time.monotonic() < deadline, "a request still runs 60 s after the stop"
        time.sleep(0.1)
    assert _metric(server, "mmkit:num_requests_waiting") == 0
    # The server generates nothing more for it, and nothing arrived on the page after the stop.
    assert message.text_content() == shown
    # The server stopped generating: far fewer tokens than the request asked for.
    assert _metric(server, "mmkit:generation_tokens") - generated_before < max_tokens

    # The page keeps working, and the stopped turn stays in the conversation.
    page.unroute("**/v1/chat/completions")
    follow_up = ask(page, QUESTION)
    assert "red" in follow_up
    assert len(page.chat_requests[-1]["messages"]) == 3


def _file_event(page, kind: str, path) -> None:
    """Drop `path` on the page, or paste it into the question box, as a browser would."""
    payload = base64.b64encode(path.read_bytes()).decode()
    page.evaluate("""([kind, name, payload]) => {
        const bytes = Uint8Array.from(atob(payload), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], name, {type: "image/png"}));
        if (kind === "paste") {
            document.getElementById("prompt").dispatchEvent(
                new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true}));
        } else {
            const target = document.getElementById("transcript");
            for (const type of ["dragenter", "dragover", "drop"])
                target.dispatchEvent(new DragEvent(type, {dataTransfer: data, bubbles: true, cancelable: true}));
        }
    }""", [kind, path.name, payload])


def test_drop_and_paste_attach_an_image_and_escape_stops(server, page):
    page.goto(server.url + "/")
    wait_connected(page)
    for kind in ("drop", "paste"):
        page.get_by_test_id("new-chat").click()
        _file_event(page, kind, RED_CIRCLE)
        page.locator("#attachment:not([hidden])").wait_for()
        assert "red_circle.png" in page.locator("#attachment-name").text_content()
        assert page.locator("#preview").evaluate("img => img.complete && img.naturalWidth > 0")
        assert page.locator("#drop-overlay").is_hidden()
        assert "red" in ask(page, QUESTION)
        assert page.chat_requests[-1]["messages"][0]["content"][0]["image_url"]["url"] == data_uri(RED_CIRCLE)

    # Escape stops an answer like the stop button does (a long one: see the stop test).
    page.route("**/v1/chat/completions", lambda route: route.continue_(
        post_data=json.dumps({**json.loads(route.request.post_data), "ignore_eos": True})))
    page.get_by_test_id("max-tokens").fill("400")
    page.get_by_test_id("prompt").fill("Describe the image.")
    page.get_by_test_id("prompt").press("Enter")
    page.wait_for_function("document.querySelectorAll('[data-testid=assistant-message]')[1]"
                           "?.textContent.length > 0", polling="raf")
    page.keyboard.press("Escape")
    page.get_by_test_id("stats").nth(1).wait_for()
    assert "stopped" in page.get_by_test_id("stats").nth(1).text_content()
    assert int(page.get_by_test_id("stats").nth(1).get_attribute("data-tokens")) < 400


def _huge_png(width: int = 12_000, height: int = 8_000) -> bytes:
    """A valid ~90 KB grey PNG of 96 M pixels: more than any image the server accepts."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    deflate = zlib.compressobj(9)
    row = b"\x00" + b"\x80" * width  # filter byte, then the pixels
    idat = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_text_file_as_image_shows_the_server_error_and_the_next_question_works(server, page):
    page.goto(server.url + "/")
    wait_connected(page)
    page.get_by_test_id("image-input").set_input_files(
        files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"shopping list: eggs, milk\n"}])
    page.get_by_test_id("prompt").fill(QUESTION)
    page.get_by_test_id("send").click()
    error = page.get_by_test_id("error")
    error.wait_for(state="visible")
    assert page.get_by_test_id("assistant-message").count() == 0
    assert page.get_by_test_id("send").is_visible()

    # The error shown is the server's own message for the body the page sent, with the part it
    # names (`messages[0].content[0]`) called by the name of the file the user chose.
    from openai import BadRequestError

    body = page.chat_requests[-1]
    with pytest.raises(BadRequestError) as exc_info:
        _openai(server).chat.completions.create(model=body["model"], messages=body["messages"], max_tokens=8)
    server_message = exc_info.value.body["message"]
    assert "image" in server_message and server_message.startswith("messages[0].content[0]")
    assert error.text_content() == "Error 400: " + server_message.replace("messages[0].content[0]",
                                                                          'the attached file "notes.txt"', 1)

    # The question comes back to the composer; a real image replaces the text file and works.
    assert page.get_by_test_id("prompt").input_value() == QUESTION
    assert "red" in ask(page, QUESTION, RED_CIRCLE)
    assert error.is_hidden()
    assert len(page.chat_requests[-1]["messages"]) == 1  # the failed turn is not part of the chat

    # A too-large image in a follow-up: the server's message again, and the chat goes on.
    page.get_by_test_id("image-input").set_input_files(
        files=[{"name": "huge.png", "mimeType": "image/png", "buffer": _huge_png()}])
    page.get_by_test_id("prompt").fill("And this one?")
    page.get_by_test_id("send").click()
    error.wait_for(state="visible")
    assert "pixels" in error.text_content() and "400" in error.text_content()
    assert 'the attached file "huge.png"' in error.text_content()  # messages[2] to the server
    page.get_by_test_id("remove-image").click()
    assert "red circle" in ask(page, "Describe the image.")
    assert len(page.chat_requests[-1]["messages"]) == 3

    # A third question's bad image is `messages[4]` to the server; the page names the file.
    page.get_by_test_id("image-input").set_input_files(
        files=[{"name": "holiday.png", "mimeType": "image/png", "buffer": b"\x89PNG\r\n\x1a\n truncated"}])
    page.get_by_test_id("prompt").fill("And this one?")
    page.get_by_test_id("send").click()
    error.wait_for(state="visible")
    assert page.chat_requests[-1]["messages"][4]["content"][0]["type"] == "image_url"
    assert error.text_content().startswith('Error 400: the attached file "holiday.png"'), error.text_content()
    assert "messages[" not in error.text_content()


def test_api_key_is_asked_once_and_a_wrong_key_gets_a_clear_401(browser, page):
    server = start_server(api_key=API_KEY)
    try:
        page.goto(server.url + "/")
        key = page.get_by_test_id("api-key")
        key.wait_for(state="visible")
        error = page.get_by_test_id("error")
        assert "401" in error.text_content() and "needs an API key" in error.text_content()
        assert page.evaluate("document.activeElement.dataset.testid") == "api-key"

        key.fill("not-the-key")
        key.press("Enter")
        page.wait_for_function("document.querySelector('[data-testid=error]').textContent.includes('rejected')")
        assert "401" in error.text_content()
        assert key.is_visible()
        assert page.evaluate("sessionStorage.getItem('mmkit.apiKey')") is None

        key.fill(API_KEY)
        key.press("Enter")
        wait_connected(page)
        assert page.get_by_test_id("api-key").count() == 0 and error.is_hidden()
        assert "red" in ask(page, QUESTION, RED_CIRCLE)

        # Asked once: a reload in the same tab finds the key in sessionStorage.
        page.reload()
        wait_connected(page)
        assert page.get_by_test_id("api-key").count() == 0
        assert "red" in ask(page, QUESTION, RED_CIRCLE)

        # A new tab: the user types the key into the key field and clicks Send (no Enter in the
        # key field); the page uses the typed key for that question and gets the answer.
        context = browser.new_context()
        tab = context.new_page()
        tab.set_default_timeout(60_000)
        try:
            tab.goto(server.url + "/")
            tab.get_by_test_id("api-key").wait_for(state="visible")
            tab.get_by_test_id("api-key").fill(API_KEY)
            assert "red" in ask(tab, QUESTION, RED_CIRCLE)  # clicks Send
            assert tab.get_by_test_id("api-key").count() == 0 and tab.get_by_test_id("error").is_hidden()
        finally:
            context.close()
    finally:
        server.stop()


def test_screenshot_helper_captures_a_conversation(server, page, tmp_path):
    from PIL import Image

    out = capture_conversation(page, server.url, tmp_path / "playground.png")
    with Image.open(out) as img:
        assert img.size == (SCREENSHOT_SIZE["width"], SCREENSHOT_SIZE["height"])
    assert page.get_by_test_id("assistant-message").count() == 2
