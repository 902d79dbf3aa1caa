"""Start `mmkit serve` as a real subprocess (port 0: the server prints the one it got)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
RED_CIRCLE = REPO / "assets" / "scenes" / "red_circle.png"
_READY = re.compile(r"ready at (http://\S+)/v1")


_SLOW_STEPS = """
import runpy, sys, time
from mmkit.worker.model_runner import ModelRunner
_execute = ModelRunner.execute_model
def _slow(self, sched):
    time.sleep({delay})
    return _execute(self, sched)
ModelRunner.execute_model = _slow
sys.argv[0] = "mmkit"
runpy.run_module("mmkit", run_name="__main__")
"""


class ServerProcess:
    """`python -m mmkit serve ...` on a free port; `.base_url` ends in /v1."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 300.0,
                 step_delay_s: float = 0.0) -> None:
        serve_args = ["serve", "--port", "0", "--threads", "1", "--log-level", "warning", *args]
        cmd = [sys.executable, "-m", "mmkit", *serve_args]
        if step_delay_s:
            # Each engine step sleeps first, so a test can act while a request still runs (the
            # embedded model writes hundreds of tokens a second). Patched in the child only.
            cmd = [sys.executable, "-c", _SLOW_STEPS.format(delay=step_delay_s), *serve_args]
        full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, cwd=str(REPO))
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("mmkit serve did not start:\n" + "".join(self.lines[-40:]))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.url = match.group(1)
                self._ready.set()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def data_uri(image: Image.Image | Path) -> str:
    if isinstance(image, Path):
        data = image.read_bytes()
    else:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(uri: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": question}]}]


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """`GET /metrics` -> {series: value} for the unlabelled mmkit series."""
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("mmkit:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_until_idle(url: str, headers: dict | None = None, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until no request is running or waiting and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        idle = (m["mmkit:num_requests_running"] == 0 and m["mmkit:num_requests_waiting"] == 0
                and m["mmkit:kv_blocks_used"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent-events response, in order."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def parse_events(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
