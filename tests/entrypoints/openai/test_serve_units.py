"""The server's pure pieces, without a server: error mapping, stream bookkeeping, prompt forms,
media policy decisions, generation-config defaults."""

from __future__ import annotations

import pytest

from mmkit.entrypoints.openai.errors import OpenAIError, bad_request
from mmkit.entrypoints.openai.media import MediaPolicy
from mmkit.entrypoints.openai.serving_completion import prompts_to_inputs
from mmkit.entrypoints.openai.serving_engine import default_sampling_from, request_error
from mmkit.entrypoints.openai.streaming import StreamState
from mmkit.errors import EngineDeadError
from mmkit.outputs import CompletionOutput
from serve_utils import RED_CIRCLE


def test_request_error_statuses():
    assert request_error(ValueError("top_p: got 5; expected 0 < top_p <= 1")).status_code == 400
    assert request_error(ValueError("top_p: got 5")).param == "top_p"
    assert request_error(TypeError("messages[0].content[1].text: got int")).param == "messages[0].content[1].text"
    dead = request_error(EngineDeadError("loop failed"))
    assert dead.status_code == 503 and dead.code == "engine_dead"
    crashed = request_error(RuntimeError("CUDA error: device-side assert"))
    assert crashed.status_code == 500 and crashed.type == "server_error" and "CUDA error" in crashed.message
    same = OpenAIError("x", 404)
    assert request_error(same) is same
    assert bad_request(ValueError("response_format.json_schema: got None")).param == "response_format.json_schema"
    assert set(same.body()["error"]) == {"message", "type", "param", "code"}


def test_stream_state_sends_each_finish_once_and_only_new_text():
    state = StreamState(2, prefixes=["echo:", ""])
    out = CompletionOutput(index=0, text="ab", token_ids=[1, 2])
    assert state.advance(out) == ("echo:ab", 0, 2)
    assert state.advance(out) is None  # nothing new
    out = CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3, 4], finish_reason="stop")
    assert state.advance(out) == ("c", 2, 4)
    assert state.advance(out) is None  # finished: never again
    held = CompletionOutput(index=1, text="", token_ids=[9], finish_reason="length")
    assert state.advance(held) == ("", 0, 1)  # a finish with no new text is still sent
    rewritten = StreamState(1)
    assert rewritten.advance(CompletionOutput(index=0, text="ab", token_ids=[1]))[0] == "ab"
    assert rewritten.advance(CompletionOutput(index=0, text="xbc", token_ids=[1, 2])) is None
    assert rewritten.advance(CompletionOutput(index=0, text="xbc", token_ids=[1, 2], finish_reason="stop")) == \
        ("", 1, 2)


def test_prompt_forms():
    assert prompts_to_inputs("hi") == [{"prompt": "hi"}]
    assert prompts_to_inputs(["a", "b"]) == [{"prompt": "a"}, {"prompt": "b"}]
    assert prompts_to_inputs([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert prompts_to_inputs([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    for bad in ([], [[1], []]):
        with pytest.raises(OpenAIError, match="empty list"):
            prompts_to_inputs(bad)


def test_media_policy(tmp_path):
    (tmp_path / "inside.png").write_bytes(RED_CIRCLE.read_bytes())
    policy = MediaPolicy.from_args(str(tmp_path), "a.example, b.example")
    assert policy.allowed_media_domains == {"a.example", "b.example"}
    assert policy.load(str(tmp_path / "inside.png"), "m").size == policy.load((tmp_path / "inside.png").as_uri(), "m").size
    with pytest.raises(ValueError, match="outside the allowed folder"):
        policy.load(str(RED_CIRCLE), "m")
    with pytest.raises(ValueError, match="'c.example' is not allowed"):
        policy.load("https://c.example/x.png", "m")
    with pytest.raises(ValueError, match="scheme 'ftp'"):
        policy.load("ftp://a.example/x.png", "m")
    closed = MediaPolicy()
    with pytest.raises(ValueError, match="only when started with --allowed-local-media-path"):
        closed.load(str(RED_CIRCLE), "m")
    with pytest.raises(ValueError, match="not a folder"):
        MediaPolicy.from_args(str(tmp_path / "inside.png"), None)


def test_generation_config_defaults(tmp_path):
    assert default_sampling_from(None) == {}
    assert default_sampling_from(str(tmp_path)) == {}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 64,'
        ' "bos_token_id": 1}')
    assert default_sampling_from(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                    "repetition_penalty": 1.05, "max_tokens": 64}


def test_app_routes_and_openapi_schema():
    from mmkit.entrypoints.openai.api_server import create_app
    from mmkit.entrypoints.openai.serving_engine import ServerConfig

    app = create_app(object(), ServerConfig(("m",), 512), enable_ui=False)  # routes only: no engine call
    paths = set(app.openapi()["paths"])
    assert {"/health", "/version", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
            "/tokenize", "/detokenize"} <= paths
    body = app.openapi()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "top_logprobs", "top_k", "response_format"} <= set(body)


def test_playground_mount_and_no_ui(tmp_path):
    from fastapi.testclient import TestClient

    from mmkit.entrypoints.openai.api_server import create_app
    from mmkit.entrypoints.openai.serving_engine import ServerConfig

    (tmp_path / "index.html").write_text("<html>playground</html>")
    config = ServerConfig(("m",), 512, api_key="k")
    with TestClient(create_app(object(), config, ui_dir=tmp_path)) as client:
        page = client.get("/")
        assert page.status_code == 200 and "playground" in page.text  # static files need no key
        assert client.get("/v1/models").status_code == 401
        assert client.post("/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"
    with TestClient(create_app(object(), config, ui_dir=tmp_path, enable_ui=False)) as client:
        assert client.get("/").status_code == 401  # --no-ui: / is an API route like the others
        missing = client.get("/", headers={"Authorization": "Bearer k"})
        assert missing.status_code == 404 and "error" in missing.json()
