"""`mmkit serve` error handling: every bad input is a 4xx with OpenAI's error body and the
next good request works; media policy (local folder, allowed hosts, redirects, limits); API
key; a client disconnect mid-stream frees the request's KV blocks; a fuzz test (no 5xx)."""

from __future__ import annotations

import base64
import http.server
import json
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_utils import RED_CIRCLE, ServerProcess, data_uri, image_message, scrape, wait_until_idle

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RED = data_uri(RED_CIRCLE)
PNG = RED_CIRCLE.read_bytes()
MAX_FETCH = 200_000


# /slow.png answers only once this is set (at the end of the module), not after a fixed delay
# that a loaded host could outlast: the server's fetch timeout (1.5 s) always comes first.
_SLOW_RELEASE = threading.Event()


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        port = self.server.server_address[1]
        routes = {
            "/red.png": (200, PNG, {}),
            "/to-same-host": (302, b"", {"Location": f"http://127.0.0.1:{port}/red.png"}),
            "/to-other-host": (302, b"", {"Location": f"http://localhost:{port}/red.png"}),
            "/big.png": (200, PNG + b"\0" * MAX_FETCH, {}),
            "/text": (200, b"hello, not an image", {}),
        }
        if self.path == "/slow.png":
            _SLOW_RELEASE.wait(300)
        status, body, headers = routes.get(self.path, (404, b"missing", {}))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the server under test hangs up on /slow.png and /big.png on purpose


@pytest.fixture(scope="module")
def image_host():
    httpd = _QuietServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _SLOW_RELEASE.set()
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(PNG)
    (folder / "escape.png").symlink_to(RED_CIRCLE)  # a link out of the folder
    return folder


@pytest.fixture(scope="module")
def server(media_dir):
    proc = ServerProcess("--api-key", KEY, "--served-model-name", "mm", "mm-alias",
                         "--allowed-local-media-path", str(media_dir), "--allowed-media-domains", "127.0.0.1",
                         "--limit-mm-per-prompt", '{"image": 2}', "--allowed-origins", "http://app.test",
                         env={"MMKIT_MAX_IMAGE_FETCH_BYTES": str(MAX_FETCH), "MMKIT_IMAGE_FETCH_TIMEOUT": "1.5"})
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def slow_server():
    """Engine steps 25 ms slower (serve_utils.ServerProcess): a 400-token answer lasts 10 s, so a
    client can leave mid-answer however fast the machine (the embedded model writes 400 in <1 s)."""
    proc = ServerProcess("--api-key", KEY, "--served-model-name", "mm", step_delay_s=0.025)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body, headers=AUTH):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.base_url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def check_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    return error


def good_request_works(client):
    r = client.chat.completions.create(model="mm", messages=image_message(RED, "What color is the circle?"),
                                       temperature=0, max_tokens=4)
    assert "red" in r.choices[0].message.content


def chat(content, **extra):
    return {"model": "mm", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def image(url):
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is it?"}]


TRUNCATED = "data:image/png;base64," + base64.b64encode(PNG[: len(PNG) // 2]).decode()
CHAT_ERRORS = {
    "bad json": ('{"model": "mm", "messages": [', None),
    "body is a list": ("[1, 2]", None),
    "no messages": ({"model": "mm"}, "messages"),
    "empty messages": ({"model": "mm", "messages": []}, "messages"),
    "bad role": ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    "content is a number": (chat(5), "messages[0].content"),
    "unknown part type": (chat([{"type": "audio", "audio": "x"}]), "messages[0].content[0].type"),
    "image_url without url": (chat([{"type": "image_url", "image_url": {}}]), "messages[0].content[0]"),
    "image_url as a bare string": (chat([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]),
                                   "messages[0].content[0]"),
    "bad base64": (chat(image("data:image/png;base64,@@@")), "messages[0].content[0]"),
    "data uri not an image": (chat(image("data:image/png;base64," + base64.b64encode(b"hi").decode())),
                              "messages[0].content[0]"),
    "truncated png": (chat(image(TRUNCATED)), "messages[0].content[0]"),
    "ftp url": (chat(image("ftp://host/red.png")), "messages[0].content[0]"),
    "path outside the folder": (chat(image(str(RED_CIRCLE))), "messages[0].content[0]"),
    "file url outside the folder": (chat(image(RED_CIRCLE.as_uri())), "messages[0].content[0]"),
    "missing local file": (chat(image("{media}/nope.png")), "messages[0].content[0]"),
    "dot-dot escape": (chat(image("{media}/../" + "x.png")), "messages[0].content[0]"),
    "symlink escape": (chat(image("{media}/escape.png")), "messages[0].content[0]"),
    "host not allowed": (chat(image("http://example.invalid/red.png")), "messages[0].content[0]"),
    "redirect to another host": (chat(image("{host}/to-other-host")), "messages[0].content[0]"),
    "download too big": (chat(image("{host}/big.png")), "messages[0].content[0]"),
    "download too slow": (chat(image("{host}/slow.png")), "messages[0].content[0]"),
    "http 404": (chat(image("{host}/missing.png")), "messages[0].content[0]"),
    "url is text": (chat(image("{host}/text")), "messages[0].content[0]"),
    "too many images": (chat(image(RED) + image(RED) + image(RED)), "messages"),
    "prompt too long": (chat("hello " * 700), "messages"),
    "temperature": (chat("hi", temperature=-1), "temperature"),
    "top_p": (chat("hi", top_p=0), "top_p"),
    "top_k": (chat("hi", top_k=-5), "top_k"),
    "n": (chat("hi", n=0), "n"),
    "max_tokens": (chat("hi", max_tokens=0), "max_tokens"),
    "presence_penalty": (chat("hi", presence_penalty=9), "presence_penalty"),
    "min_tokens above max_tokens": (chat("hi", min_tokens=9), "min_tokens"),
    "empty stop string": (chat("hi", stop=[""]), "stop[0]"),
    "top_logprobs too large": (chat("hi", logprobs=True, top_logprobs=50), "top_logprobs"),
    "seed of the wrong type": (chat("hi", seed="abc"), "seed"),
    "temperature of the wrong type": (chat("hi", temperature="hot"), "temperature"),
    # 400 with or without structured outputs in the engine: a schema-less json_schema, an unknown key.
    "response_format without schema": (chat("hi", response_format={"type": "json_schema"}), None),
    "structured_outputs unknown key": (chat("hi", structured_outputs={"xml": "<a/>"}), None),
}


@pytest.mark.parametrize("case", list(CHAT_ERRORS))
def test_bad_chat_input_is_a_400_then_the_server_still_serves(server, client, media_dir, image_host, case):
    body, param = CHAT_ERRORS[case]
    if not isinstance(body, str):
        body = json.loads(json.dumps(body).replace("{media}", str(media_dir)).replace("{host}", image_host))
    error = check_error(post(server, "/chat/completions", body), 400, param)
    if case.startswith(("path", "file url", "dot-dot", "symlink")):
        assert "outside the allowed folder" in error["message"]
    if case.startswith(("response_format", "structured_outputs")):
        assert error["param"].startswith(case.split()[0]), error
    if case == "bad json":
        assert "not valid JSON" in error["message"]
    if case == "image_url as a bare string":  # OpenAI's and vLLM's 400; the message shows the object form
        assert '{"url": ' in error["message"], error
    if case == "prompt too long":
        assert "max_model_len" in error["message"]
    good_request_works(client)


COMPLETION_ERRORS = {
    "empty prompt list": ({"model": "mm", "prompt": []}, "prompt"),
    "mixed prompt list": ({"model": "mm", "prompt": ["a", [1, 2]]}, "prompt"),
    "token id out of range": ({"model": "mm", "prompt": [1, 10**6]}, "prompt"),
    "second prompt too long": ({"model": "mm", "prompt": ["hi", "hello " * 700]}, "prompt[1]"),
    "logprobs too large": ({"model": "mm", "prompt": "hi", "logprobs": 9}, "logprobs"),
    "negative max_tokens": ({"model": "mm", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
}


@pytest.mark.parametrize("case", list(COMPLETION_ERRORS))
def test_bad_completion_input_is_a_400(server, client, case):
    body, param = COMPLETION_ERRORS[case]
    check_error(post(server, "/completions", body), 400, param)
    good_request_works(client)
    assert wait_until_idle(server.url, AUTH)["mmkit:kv_blocks_used"] == 0  # started prompts were aborted


def test_allowed_media_sources_work(client, media_dir, image_host):
    sources = [str(media_dir / "red.png"), (media_dir / "red.png").as_uri(), f"{image_host}/red.png",
               f"{image_host}/to-same-host"]
    for url in sources:
        r = client.chat.completions.create(model="mm-alias", messages=image_message(url, "What color is the circle?"),
                                           temperature=0, max_tokens=4)
        assert "red" in r.choices[0].message.content, url


def test_unknown_model_is_a_404(server, client):
    error = check_error(post(server, "/chat/completions", {**chat("hi"), "model": "gpt-4o"}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    good_request_works(client)
    assert 'mmkit:http_requests_total{status="404"}' in httpx.get(server.url + "/metrics", headers=AUTH).text


def test_api_key(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/chat/completions", "/completions"):
            assert check_error(post(server, path, chat("hi"), headers), 401)["code"] == "invalid_api_key"
        assert httpx.get(server.base_url + "/models", headers=headers).status_code == 401
        assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["mm", "mm-alias"]


def test_unknown_fields_are_ignored_and_unknown_routes_are_404(server, client):
    r = post(server, "/chat/completions", {**chat("hi"), "frobnicate": True, "metadata": {"a": 1}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    check_error(httpx.get(server.base_url + "/nothing-here", headers=AUTH), 404)


def test_disconnect_mid_stream_aborts_and_frees_blocks(slow_server):
    server = slow_server
    before = scrape(server.url, AUTH)
    body = {**chat([{"type": "image_url", "image_url": {"url": RED}}, {"type": "text", "text": "Describe."}]),
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/chat/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) >= 3:
                    break  # leave the stream: the connection closes
    after = wait_until_idle(server.url, AUTH)
    assert after["mmkit:num_requests_running"] == 0 and after["mmkit:kv_blocks_used"] == 0
    generated = after["mmkit:generation_tokens_total"] - before["mmkit:generation_tokens_total"]
    assert generated < 400  # aborted, not run to its end
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'mmkit:http_requests_total{status="disconnected"}' in text


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=8))
_URLS = st.sampled_from([RED, "data:image/png;base64,AAAA", "/etc/passwd", "http://example.invalid/x.png",
                         "file:///etc/hosts", "", "data:,", TRUNCATED])
_PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=20), _SCALARS)}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": _URLS}), _URLS, _SCALARS)}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), _SCALARS, max_size=3),
)
_MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=30), st.lists(_PARTS, max_size=3), _SCALARS)}),
    _SCALARS), max_size=3)
_BODIES = st.fixed_dictionaries(
    {"messages": st.one_of(_MESSAGES, _SCALARS), "max_tokens": st.one_of(st.integers(-1, 5), _SCALARS)},
    optional={"model": st.sampled_from(["mm", "other", 3]), "temperature": _SCALARS, "top_p": _SCALARS,
              "n": st.one_of(st.integers(-1, 3), _SCALARS), "stream": st.booleans(), "stop": _SCALARS,
              "seed": _SCALARS, "logprobs": _SCALARS, "top_logprobs": _SCALARS, "top_k": _SCALARS,
              "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": _SCALARS}), _SCALARS),
              "response_format": st.one_of(st.fixed_dictionaries({"type": st.text(max_size=6)}), _SCALARS),
              "presence_penalty": _SCALARS, "min_tokens": _SCALARS, "max_completion_tokens": _SCALARS})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_BODIES)
def test_fuzz_chat_endpoint_never_answers_5xx(server, body):
    raw = json.dumps(body, allow_nan=True)  # NaN and Infinity too: Python's json accepts them
    with httpx.stream("POST", server.base_url + "/chat/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json", **AUTH}) as response:
        content = response.read()
    assert response.status_code < 500, content
    if response.status_code >= 400:
        assert set(json.loads(content)["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_disconnect_before_a_whole_answer_aborts_it(slow_server, path):
    server = slow_server
    before = scrape(server.url, AUTH)
    body = {"model": "mm", "max_tokens": 400, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "Describe."}]} if path == "/chat/completions"
                else {"prompt": "USER: Describe. ASSISTANT:"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + path, json=body, headers=AUTH, timeout=httpx.Timeout(10, read=0.3))
    after = wait_until_idle(server.url, AUTH)
    assert after["mmkit:num_requests_running"] == 0 and after["mmkit:kv_blocks_used"] == 0
    assert after["mmkit:generation_tokens_total"] - before["mmkit:generation_tokens_total"] < 400


def test_cors_preflight_passes_for_allowed_origins_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(server.base_url + "/chat/completions", headers={"Origin": "http://app.test", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.test"
    other = httpx.options(server.base_url + "/chat/completions", headers={"Origin": "http://evil.test", **preflight})
    assert "access-control-allow-origin" not in other.headers


_PROMPTS = st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                     st.lists(st.integers(-5, 500), max_size=6), st.lists(st.lists(st.integers(-1, 450), max_size=4),
                                                                         max_size=3), _SCALARS)
_COMPLETION_BODIES = st.fixed_dictionaries(
    {"prompt": _PROMPTS, "max_tokens": st.one_of(st.integers(-1, 4), _SCALARS)},
    optional={"model": st.sampled_from(["mm", "x"]), "n": st.one_of(st.integers(0, 3), _SCALARS),
              "logprobs": st.one_of(st.integers(-1, 7), _SCALARS), "echo": _SCALARS, "stream": st.booleans(),
              "temperature": _SCALARS, "stop": _SCALARS, "seed": _SCALARS, "ignore_eos": _SCALARS})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_COMPLETION_BODIES)
def test_fuzz_completions_endpoint_never_answers_5xx(server, body):
    with httpx.stream("POST", server.base_url + "/completions", content=json.dumps(body, allow_nan=True),
                      timeout=60, headers={"content-type": "application/json", **AUTH}) as response:
        content = response.read()
    assert response.status_code < 500, content
    if response.status_code >= 400:
        assert set(json.loads(content)["error"]) == {"message", "type", "param", "code"}
