"""Browser-test harness for the playground page: a real Chromium and a real `mmkit serve` subprocess.

Used by tests/entrypoints/ui/test_ui_browser.py, and as a script that makes docs/serving.md's screenshot:

    python tests/ui_harness.py docs/playground.png

Chromium: $MMKIT_CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH
(Debian's `apt-get install chromium` gives /usr/bin/chromium). It is driven through Playwright
for Python with `executable_path`; no browser is ever downloaded.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, too

from serve_utils import RED_CIRCLE, REPO, ServerProcess  # noqa: E402

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags for a quiet, offline, containerised run (no sandbox: CI containers often run as root).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def find_chromium() -> Optional[str]:
    """The Chromium executable to drive, or None when the machine has none."""
    explicit = os.environ.get("MMKIT_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_missing_reason() -> Optional[str]:
    """Why the browser tests cannot run here (None when they can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install playwright; no browser download needed)"
    if find_chromium() is None:
        return ("no Chromium browser found (apt-get install chromium, or set MMKIT_CHROMIUM); "
                "MMKIT_REQUIRE_BROWSER=1 makes this a failure")
    return None


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_ARGS)


def start_server(api_key: Optional[str] = None, step_delay_s: float = 0.0) -> ServerProcess:
    """`mmkit serve` with the embedded model on a free port (tests/serve_utils.py); stop() ends it.
    `step_delay_s` slows every engine step (serve_utils.ServerProcess), for tests that act mid-answer."""
    if api_key:
        return ServerProcess("--api-key", api_key, step_delay_s=step_delay_s)
    # a key in the caller's environment must not leak in
    return ServerProcess(env={"MMKIT_API_KEY": ""}, step_delay_s=step_delay_s)


@contextmanager
def serve(api_key: Optional[str] = None) -> Iterator[ServerProcess]:
    server = start_server(api_key)
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------ page actions shared with the tests
def wait_connected(page, timeout_ms: int = 30_000) -> None:
    """The page has loaded and reached the API (the model name is shown)."""
    page.wait_for_function("document.getElementById('model-name').textContent.startsWith('model: ')",
                           timeout=timeout_ms)


def ask(page, question: str, image: Optional[Path] = None, *, press_enter: bool = False,
        timeout_ms: int = 60_000) -> str:
    """Attach `image` (if any), ask `question`, wait for the answer's stats; return the answer."""
    answers_before = page.get_by_test_id("stats").count()
    if image is not None:
        page.get_by_test_id("image-input").set_input_files(str(image))
        page.locator("#attachment:not([hidden])").wait_for()
    page.get_by_test_id("prompt").fill(question)
    if press_enter:
        page.get_by_test_id("prompt").press("Enter")
    else:
        page.get_by_test_id("send").click()
    page.get_by_test_id("stats").nth(answers_before).wait_for(timeout=timeout_ms)
    return page.get_by_test_id("assistant-message").nth(answers_before).text_content()


SCREENSHOT_SIZE = {"width": 1000, "height": 800}


def capture_conversation(page, url: str, out: Path) -> Path:
    """Ask about the red circle, follow up, attach a second scene; save the page as a PNG."""
    page.set_viewport_size(SCREENSHOT_SIZE)
    page.emulate_media(color_scheme="light")
    page.goto(url + "/")
    wait_connected(page)
    ask(page, "What color is the circle?", RED_CIRCLE, press_enter=True)
    ask(page, "Describe the image.")
    page.get_by_test_id("image-input").set_input_files(str(REPO / "assets" / "scenes" / "scene_1.png"))
    page.locator("#attachment:not([hidden])").wait_for()
    page.get_by_test_id("prompt").fill("How many shapes are there?")
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    return out


def make_screenshot(out: Path) -> Path:
    """Start a server and a browser, and capture the conversation at `out`."""
    from playwright.sync_api import sync_playwright

    reason = browser_missing_reason()
    if reason:
        raise RuntimeError(reason)
    with serve() as server, sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            return capture_conversation(browser.new_page(), server.url, out)
        finally:
            browser.close()


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "playground.png"
    print(make_screenshot(target))
