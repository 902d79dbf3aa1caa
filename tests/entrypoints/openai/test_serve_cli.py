"""`mmkit serve` as a command: SIGTERM/SIGINT stop it with exit status 0 (in-flight requests
aborted), MMKIT_API_KEY, flag errors, and `import mmkit` never importing the server stack."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from serve_utils import REPO, ServerProcess
from mmkit.config import default_model_path


def _stream(url: str, results: list, started: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                results.append(("status", response.status_code, response.read().decode()))
                return
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) >= 3:
                        started.set()
            results.append(("stream", 200, events))
    except httpx.HTTPError as exc:  # the server closed the connection
        results.append(("closed", None, repr(exc)))


def test_sigterm_aborts_in_flight_requests_and_exits_0():
    # One sequence at a time: of four long requests, three wait in the queue when the signal comes.
    server = ServerProcess("--max-num-seqs", "1")
    results: list = []
    started = threading.Event()
    threads = [threading.Thread(target=_stream, args=(server.url, results, started)) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(120), server.output()
    t0 = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0, server.output()[-3000:]
    stop_s = time.monotonic() - t0
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert len(results) == 4
    print([(kind, status) for kind, status, _ in results], f"stopped in {stop_s:.1f} s")
    finished_whole = 0
    for kind, status, payload in results:
        if kind == "stream":
            assert payload[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payload[:-1]]
            whole = any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
            finished_whole += whole
            if not whole:  # cut short: the stream says why, then ends properly
                assert chunks[-1]["error"]["code"] == "engine_dead"
        elif kind == "status":
            assert status == 503 and json.loads(payload)["error"]["message"]
    assert finished_whole < 4  # the signal aborted requests; it did not wait for them all


def test_sigint_exits_0_api_key_from_the_environment_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 3}')
    template = (default_model_path() / "chat_template.jinja").read_text()
    (tmp_path / "template.jinja").write_text("PREFIX " + template)
    server = ServerProcess("--generation-config", str(tmp_path), "--chat-template", str(tmp_path / "template.jinja"),
                           env={"MMKIT_API_KEY": "from-env"})
    key = {"Authorization": "Bearer from-env"}
    try:
        assert httpx.get(server.base_url + "/models").status_code == 401
        ok = httpx.get(server.base_url + "/models", headers=key)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "default-model"
        assert httpx.get(server.url + "/health").status_code == 200
        # Unset fields take the generation config's values: greedy (n=4 identical), 3 tokens.
        body = {"prompt": "USER: Describe", "ignore_eos": True, "n": 4, "seed": 1, "max_tokens": None}
        greedy = httpx.post(server.base_url + "/completions", json=body, headers=key).json()
        assert greedy["usage"]["completion_tokens"] == 4 * 3
        assert len({c["text"] for c in greedy["choices"]}) == 1
        sampled = httpx.post(server.base_url + "/completions", json={**body, "temperature": 1.0},
                             headers=key).json()
        assert len({c["text"] for c in sampled["choices"]}) > 1  # a set temperature wins
        # --chat-template FILE replaces the checkpoint's template.
        ids = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                         headers=key).json()["tokens"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=key).json()["prompt"]
        assert text.replace("<s>", "").strip().startswith("PREFIX USER: hi")
    finally:
        t0 = time.monotonic()
        code = server.stop(signal.SIGINT)
        print(f"stopped in {time.monotonic() - t0:.1f} s")
    assert code == 0, server.output()[-3000:]
    assert "ready at http://127.0.0.1:" in server.output()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmkit", *args], capture_output=True, text=True, cwd=str(REPO),
                          timeout=300)


def test_bad_flags_are_clear_errors():
    result = _run("serve", "--limit-mm-per-prompt", "{image: 2}")
    assert result.returncode == 2 and "--limit-mm-per-prompt" in result.stderr and "JSON" in result.stderr
    result = _run("serve", "--allowed-local-media-path", str(REPO / "no-such-folder"))
    assert result.returncode == 2 and "--allowed-local-media-path" in result.stderr
    result = _run("serve", "--generation-config", str(REPO / "no-such-folder"))
    assert result.returncode == 2 and "--generation-config" in result.stderr
    help_text = _run("serve", "--help").stdout
    for flag in ("--model", "--host", "--port", "--served-model-name", "--api-key", "--dtype", "--device",
                 "--max-model-len", "--max-num-seqs", "--limit-mm-per-prompt", "--allowed-local-media-path",
                 "--allowed-media-domains", "--chat-template", "--no-ui"):
        assert flag in help_text


def test_import_mmkit_does_not_import_the_server_stack():
    code = ("import sys, mmkit, mmkit.entrypoints.cli.main; mmkit.entrypoints.cli.main.build_parser(); from mmkit import LLM, AsyncLLMEngine; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', "
            "'prometheus_client', 'openai')]; print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def _taken_port() -> tuple["socket.socket", int]:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


# `mmkit serve` whose model load announces itself on stderr and exits 3 (patched in the child).
_MARK_MODEL_LOAD = """
import runpy, sys
from mmkit.worker import model_runner
def _load(*args, **kwargs):
    print("MODEL LOAD STARTED", file=sys.stderr, flush=True)
    raise SystemExit(3)
model_runner.load_model = _load
sys.argv[0] = "mmkit"
runpy.run_module("mmkit", run_name="__main__")
"""


def test_a_taken_port_fails_before_the_model_loads():
    sock, port = _taken_port()
    try:
        out = subprocess.run([sys.executable, "-c", _MARK_MODEL_LOAD, "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    finally:
        sock.close()
    assert out.returncode == 2, out.stderr
    assert f"port {port}" in out.stderr and "already in use" in out.stderr and "Traceback" not in out.stderr
    # Checked before the model loads (so it fails fast on any host): the load never started.
    assert "loading" not in out.stdout and "MODEL LOAD STARTED" not in out.stderr


def test_paths_are_checked_before_the_model_loads(tmp_path):
    for args, needle in ((["--allowed-local-media-path", str(tmp_path / "nope")], "--allowed-local-media-path"),
                         (["--chat-template", str(tmp_path / "none.jinja")], "--chat-template"),
                         (["--generation-config", str(tmp_path)], "--generation-config"),
                         (["--model", str(tmp_path / "no-model")], "--model")):
        out = subprocess.run([sys.executable, "-m", "mmkit", "serve", "--port", "0", *args], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "loading" not in out.stdout
