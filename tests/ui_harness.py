"""Browser-test harness for the playground page: a real `mmkit serve` subprocess and a real Chromium.

Used by tests/test_ui_browser.py, and as a script that makes the README's screenshot:

    python tests/ui_harness.py docs/playground.png

Chromium: $MMKIT_CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH
(Debian's `apt-get install chromium` gives /usr/bin/chromium). It is driven through Playwright
for Python with `executable_path`; no browser is ever downloaded.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
RED_CIRCLE = REPO / "assets" / "scenes" / "red_circle.png"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags for a quiet, offline, containerised run (no sandbox: CI containers often run as root).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SERVER_START_TIMEOUT_S = 180.0


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`mmkit serve` with the embedded model on a free local port, as a subprocess."""

    def __init__(self, api_key: Optional[str] = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mmkit", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--threads", "1", "--log-level", "warning", *extra_args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.pop("MMKIT_API_KEY", None)  # only --api-key decides
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mmkit-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mmkit serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.close()
        raise RuntimeError(f"mmkit serve did not become healthy in {SERVER_START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {name: value} for the unlabelled samples."""
        request = urllib.request.Request(self.url + "/metrics")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@contextmanager
def serve(api_key: Optional[str] = None) -> Iterator[ServeProcess]:
    server = ServeProcess(api_key=api_key)
    try:
        yield server
    finally:
        server.close()


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


SCREENSHOT_SIZE = {"width": 960, "height": 720}


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
