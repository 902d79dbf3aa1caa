"""`mmkit serve --ray-serve` from the command line: a local Ray with two replicas on a 2-core
machine answers the API, and SIGTERM exits 0 with no Ray process left behind.

Slow (Ray and two replicas start in the subprocess): `python -m pytest -m slow tests/ray/test_ray_serve_cli.py`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from conftest import get_llm  # noqa: E402
from mmkit import SamplingParams  # noqa: E402
from mmkit.config import default_model_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"ready at (http://\S+)/v1")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (Ray's GCS, raylet, agents and workers), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_cli_two_replicas_answer_and_sigterm_leaves_nothing():
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "mmkit", "serve", "--ray-serve", "--num-replicas", "2",
                             "--port", "0", "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if _READY.search(line):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not ready.wait(0.5):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-60:])
        url = next(_READY.search(line).group(1) for line in lines if _READY.search(line))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        ref = get_llm(default_model_path()).chat(messages, SamplingParams(temperature=0, max_tokens=8),
                                                 use_tqdm=False)[0]
        assert r.choices[0].message.content == ref.outputs[0].text
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        children = descendants(proc.pid)
        assert children, "Ray started no process below the command?"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(lines[-60:])
        deadline = time.monotonic() + 30  # Ray's agents notice their raylet is gone within seconds
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in children if alive(p)]
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in children:  # only what this test started, if the assertion above failed
            if alive(p):
                os.kill(p, signal.SIGKILL)
