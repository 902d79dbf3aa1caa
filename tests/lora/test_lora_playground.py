"""The playground's model picker offers the LoRA adapters `mmkit serve` lists, and a chat sent
with an adapter picked runs under it (real headless Chromium; skips without a browser as
tests/entrypoints/ui/test_ui_browser.py does)."""

from __future__ import annotations

import os

import pytest

from serve_utils import ServerProcess
from ui_harness import ask, browser_missing_reason, launch_chromium, wait_connected


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = browser_missing_reason()
    if reason is not None:
        if os.environ.get("MMKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MMKIT_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    from transformers import AutoConfig

    from mmkit.config import default_model_path
    from mmkit.testing.lora import decoder_shapes, write_random_adapter

    text = AutoConfig.from_pretrained(default_model_path()).get_text_config()
    path = write_random_adapter(tmp_path_factory.mktemp("ui_lora"), decoder_shapes(text), seed=5, std=0.05)
    proc = ServerProcess("--enable-lora", "--lora-modules", f"poet={path}", "--max-lora-rank", "8",
                         env={"MMKIT_API_KEY": ""})
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.mark.slow  # a server and a browser: over a minute on a small shared CPU
def test_model_picker_selects_the_adapter(server):
    from openai import OpenAI
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page()
        bodies = []
        page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
        page.goto(server.url + "/")
        wait_connected(page)
        picker = page.get_by_test_id("model-picker")
        assert picker.is_visible()
        options = picker.locator("option").all_text_contents()
        assert options == ["default-model", "poet (adapter of default-model)"]
        picker.select_option("poet")
        page.get_by_test_id("temperature").fill("0")
        page.get_by_test_id("max-tokens").fill("12")
        answer = ask(page, "Write a haiku.")
        browser.close()
    assert bodies[-1]["model"] == "poet"
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

    def api(model):
        return client.chat.completions.create(model=model, messages=bodies[-1]["messages"], temperature=0,
                                              max_tokens=12).choices[0].message.content

    assert answer == api("poet") != api("default-model")
