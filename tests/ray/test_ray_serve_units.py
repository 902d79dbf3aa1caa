"""The Ray Serve path's parts without a Ray cluster: routing keys, the affinity router's ranks,
the server's app called in-process (as each replica calls it), `build_app`'s and the CLI's
argument checks, and `build_processor`'s dict of sampling fields."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from conftest import make_image  # noqa: E402
from mmkit.ray.serve_router import AffinityRouter, routing_key  # noqa: E402
from serve_utils import data_uri, image_message  # noqa: E402


def chat_body(messages, **fields) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **fields}).encode()


def test_routing_key_is_the_first_image_else_the_prompt_prefix():
    red, blue = data_uri(make_image(1)), data_uri(make_image(2))
    path = "/v1/chat/completions"
    key = routing_key(path, chat_body(image_message(red, "What color?")))
    assert key.startswith("image:")
    assert routing_key(path, chat_body(image_message(red, "Another question"), stream=True)) == key
    assert routing_key(path, chat_body(image_message(blue, "What color?"))) != key
    hello = chat_body([{"role": "user", "content": "hello there"}])
    text = routing_key(path, hello)
    assert text.startswith("text:") and text == routing_key(path, hello)
    assert routing_key(path, chat_body([{"role": "user", "content": "goodbye"}])) != text
    assert routing_key("/v1/completions", b'{"prompt": ["a b", "c"]}') == routing_key("/v1/completions",
                                                                                     b'{"prompt": "a b"}')
    assert routing_key(path, b"{not json") is None
    assert routing_key("/v1/models", b"") is None
    assert routing_key("/tokenize", b'{"prompt": "a"}') is None


def fake_router(queue_lens: dict[str, int], threshold: int = 2) -> AffinityRouter:
    router = object.__new__(AffinityRouter)  # the ranking needs only the queue-length cache
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: queue_lens.get(rid.unique_id))
    router.initialize_state(imbalanced_threshold=threshold)
    return router


def replicas(*ids: str):
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i), max_ongoing_requests=8) for i in ids]


def rank(router, candidates, **kwargs):
    ranks = asyncio.run(router.choose_replicas(candidates, SimpleNamespace(kwargs=kwargs)))
    return [[r.replica_id.unique_id for r in group] for group in ranks]


def test_router_keeps_a_key_on_one_replica_until_it_is_overloaded():
    three = replicas("a", "b", "c")
    router = fake_router({})
    first = {key: rank(router, three, routing_key=key)[0] for key in map(str, range(60))}
    assert all(len(v) == 1 for v in first.values())
    assert {v[0] for v in first.values()} == {"a", "b", "c"}  # keys spread over the replicas
    for key, (preferred,) in first.items():  # stable, and a replica's removal moves only its keys
        assert rank(router, three, routing_key=key)[0] == [preferred]
        rest = [r for r in three if r.replica_id.unique_id != "c"]
        if preferred != "c":
            assert rank(router, rest, routing_key=key)[0] == [preferred]
    key = next(k for k, v in first.items() if v == ["a"])
    assert rank(fake_router({"a": 3, "b": 1, "c": 2}), three, routing_key=key)[0] == ["a"]  # 3 - 1 <= 2
    fallback = rank(fake_router({"a": 4, "b": 1, "c": 2}), three, routing_key=key)  # 4 - 1 > 2: shorter queue
    assert len(fallback) == 1 and len(fallback[0]) == 2
    assert len(rank(router, three)[0]) == 2  # no key: two random replicas


@pytest.fixture(scope="module")
def loop():
    # One loop for the module: the engine's background loop lives in the loop that first used it
    # (as in a Serve replica, whose loop lives as long as the replica).
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def app(loop):
    from mmkit.engine.async_engine import AsyncLLMEngine
    from mmkit.config import EngineArgs
    from mmkit.entrypoints.openai.api_server import create_app, server_config
    from mmkit.entrypoints.openai.media import MediaPolicy

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=None, max_num_seqs=4))
    config = server_config(engine, model=None, served_model_name="m", media=MediaPolicy(), chat_template=None,
                           api_key="k", allowed_origins=None)
    yield SimpleNamespace(app=create_app(engine, config), loop=loop)
    loop.run_until_complete(asyncio.sleep(0))
    engine.shutdown()


def call(served, path: str, body: dict | None = None, key: str | None = "k", stop_after: int | None = None):
    from mmkit.entrypoints.openai.in_process import HTTPRequest, call_app

    headers = [(b"content-type", b"application/json")] + ([(b"authorization", f"Bearer {key}".encode())]
                                                           if key else [])
    request = HTTPRequest("POST" if body is not None else "GET", path, headers=tuple(headers),
                          body=json.dumps(body).encode() if body is not None else b"")

    async def run():
        parts = []
        stream = call_app(served.app, request)
        async for part in stream:
            parts.append(part)
            if stop_after is not None and len(parts) >= stop_after:
                await stream.aclose()  # the caller's client went away
                await asyncio.sleep(0.5)
                break
        return parts

    parts = served.loop.run_until_complete(run())
    return parts[0], b"".join(parts[1:])


def test_the_server_app_in_process_answers_streams_and_checks_the_key(app):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    start, body = call(app, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 6,
                                                     "temperature": 0})
    assert start.status == 200 and start.header(b"content-type") == b"application/json"
    whole = json.loads(body)["choices"][0]["message"]["content"]
    start, body = call(app, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 6,
                                                     "temperature": 0, "stream": True})
    assert start.header(b"content-type").startswith(b"text/event-stream")
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"]) == whole
    start, body = call(app, "/v1/models", key=None)
    assert start.status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    start, _ = call(app, "/health", key=None)
    assert start.status == 200


def test_leaving_a_stream_early_aborts_its_request(app):
    body = {"model": "m", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    call(app, "/v1/chat/completions", body, stop_after=3)
    assert not app.app.state.engine.engine.has_unfinished_requests()


def test_build_app_checks_its_arguments_before_any_replica_starts(tmp_path):
    from ray import serve

    from mmkit.ray.serve import build_app

    assert isinstance(build_app(None, num_replicas=2, dtype="float32"), serve.Application)
    assert isinstance(build_app(autoscaling_config={"min_replicas": 1, "max_replicas": 3}), serve.Application)
    with pytest.raises(ValueError, match="num_replicas: got 0"):
        build_app(num_replicas=0)
    with pytest.raises(ValueError, match="num_replicas: got 2 with an autoscaling_config"):
        build_app(num_replicas=2, autoscaling_config={"max_replicas": 3})
    with pytest.raises(ValueError, match="num_cpus_per_replica"):
        build_app(num_cpus_per_replica=0)
    with pytest.raises(TypeError, match="max_num_seqz"):
        build_app(max_num_seqz=4)
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        build_app(allowed_local_media_path=tmp_path / "missing")
    with pytest.raises(ValueError, match="chat-template"):
        build_app(chat_template="no_such_template.jinja")


def test_cli_ray_flags(capsys):
    from mmkit.entrypoints.cli.main import main

    assert main(["serve", "--num-replicas", "2"]) == 2
    assert "--num-replicas: only with --ray-serve" in capsys.readouterr().err
    assert main(["serve", "--ray-serve", "--threads", "2"]) == 2
    assert "--threads: with --ray-serve" in capsys.readouterr().err


def test_build_processor_takes_a_dict_of_sampling_fields():
    from mmkit import SamplingParams
    from mmkit.ray import build_processor

    p = build_processor(sampling_params={"temperature": 0, "max_tokens": 8})
    assert p.sampling_params == SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_tokenz'\]"):
        build_processor(sampling_params={"temperature": 0, "max_tokenz": 8})
    with pytest.raises(ValueError, match="sampling_params: .*top_p"):
        build_processor(sampling_params={"top_p": 7})
    with pytest.raises(TypeError, match="sampling_params: got list"):
        build_processor(sampling_params=[("temperature", 0)])
