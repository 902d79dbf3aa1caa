"""`mmkit.ray.serve.build_app` on a local Ray (2 logical CPUs) with two engine replicas of the
embedded model: one Ray and one Serve app for the whole module, answers from the official
openai client checked against `LLM.chat`, then a replica killed while it streams (last).

Slow (Ray and two replicas take about a minute to start on two shared cores):
`python -m pytest -m slow tests/ray/test_ray_serve.py`.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from conftest import get_llm  # noqa: E402
from mmkit import SamplingParams  # noqa: E402
from mmkit.config import default_model_path  # noqa: E402
from mmkit.eval.scenes import COLORS, SHAPES, draw_shape  # noqa: E402
from serve_utils import data_uri, image_message  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "sk-ray-serve-test"
MODEL = "tiny"
ENGINE = "LLMServer"


@pytest.fixture(scope="module")
def base_url():
    from mmkit.ray.serve import build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(None, num_replicas=2, served_model_name=MODEL, api_key=KEY, max_num_seqs=32),
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def llm():
    return get_llm(default_model_path())


def async_client(base_url: str) -> openai.AsyncOpenAI:
    # No retries: a failure must be seen as it is, not hidden by the client sending it again.
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def metrics(name: str) -> dict[str, float]:
    from mmkit.ray.serve import metric_value, replica_metrics

    return {rid: metric_value(text, name) for rid, text in replica_metrics().items()}


def conversation(i: int) -> list[dict]:
    if i % 2 == 0:  # 20 different pictures
        image = draw_shape(SHAPES[i // 2 % 3], COLORS[i // 2 % 6], (64 + 8 * (i // 12), 48))
        return image_message(data_uri(image), ["What color is it?", "Describe the image.", "What shape?"][i % 3])
    return [{"role": "user", "content": f"Question {i}: say something about the number {i}."}]


async def ask(client: openai.AsyncOpenAI, messages: list[dict], stream: bool, max_tokens: int = 12,
              **extra) -> str:
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, extra_body=extra or None)
        return r.choices[0].message.content
    chunks = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body=extra or None)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


def test_40_concurrent_chats_equal_llm_chat_on_both_replicas(base_url, llm):
    convs = [conversation(i) for i in range(40)]
    refs = [o.outputs[0].text for o in llm.chat(convs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    before = metrics("mmkit:request_success_total")

    async def run():
        async with async_client(base_url) as client:
            return await asyncio.gather(*(ask(client, m, stream=i % 3 == 0) for i, m in enumerate(convs)))

    answers = asyncio.run(run())
    assert answers == refs
    after = metrics("mmkit:request_success_total")
    assert len(after) == 2 and set(before) == set(after)
    served = {rid: after[rid] - before[rid] for rid in after}
    assert sum(served.values()) == 40 and all(n > 0 for n in served.values()), served
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"}
    assert {f"SERVE_REPLICA::default#{ENGINE}#{rid}" for rid in after} <= names


def test_ten_questions_about_one_new_image_miss_the_encoder_cache_once(base_url, llm):
    uri = data_uri(draw_shape("triangle", "orange", (91, 77)))
    questions = ["What color is it?", "What shape is it?", "Describe the image.", "Is it large?", "Where is it?",
                 "How many shapes?", "Is the background white?", "Name the colour.", "Caption it.", "Anything else?"]
    misses, hits = metrics("mmkit:encoder_cache_misses_total"), metrics("mmkit:encoder_cache_hits_total")

    async def run():
        async with async_client(base_url) as client:
            answers = [await ask(client, image_message(uri, questions[0]), stream=False)]
            for start in range(1, 10, 3):  # a user's next questions, a few at a time
                answers += await asyncio.gather(*(ask(client, image_message(uri, q), stream=True)
                                                  for q in questions[start:start + 3]))
            return answers

    answers = asyncio.run(run())
    refs = llm.chat([image_message(uri, q) for q in questions], SamplingParams(temperature=0, max_tokens=12),
                    use_tqdm=False)
    assert answers == [o.outputs[0].text for o in refs]
    new_misses = {rid: v - misses[rid] for rid, v in metrics("mmkit:encoder_cache_misses_total").items()}
    new_hits = {rid: v - hits[rid] for rid, v in metrics("mmkit:encoder_cache_hits_total").items()}
    assert sum(new_misses.values()) == 1, new_misses  # not once per replica
    assert sorted(new_hits.values()) == [0, 9], new_hits  # every later question on the same replica


def test_api_key_media_rules_and_other_routes(base_url):
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200  # open, as in mmkit serve
    r = httpx.get(base_url + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert [m["id"] for m in httpx.get(base_url + "/v1/models", headers=auth, timeout=30).json()["data"]] == [MODEL]
    r = httpx.post(base_url + "/v1/chat/completions", headers=auth, timeout=60, json={
        "model": MODEL, "messages": image_message("http://example.com/cat.png", "What is it?")})
    assert r.status_code == 400 and "allowed-media-domains" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/tokenize", headers=auth, timeout=60, json={"model": MODEL, "prompt": "hello"})
    assert r.status_code == 200 and r.json()["count"] > 0
    r = httpx.post(base_url + "/v1/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_killed_replica_fails_its_requests_only_and_is_replaced(base_url):
    """Long requests on both replicas; one replica's actor is killed while they stream."""
    long = dict(max_tokens=400, ignore_eos=True)

    async def outcome(client, i: int, stream: bool):
        messages = conversation(i)
        try:
            text = await ask(client, messages, stream=stream, **long)
        except openai.APIStatusError as exc:  # a whole answer: a 5xx
            return ("status", exc.status_code)
        except openai.APIError as exc:  # a stream: the error event, or the connection broke
            return ("stream_error", type(exc).__name__, str(exc))
        return ("ok", text)

    async def run():
        async with async_client(base_url) as client:
            tasks = [asyncio.ensure_future(outcome(client, i, stream=i % 2 == 0)) for i in range(12)]
            old_ids = set(await asyncio.to_thread(wait_for_running_requests))
            victim = sorted(old_ids)[0]
            ray.kill(ray.get_actor(f"SERVE_REPLICA::default#{ENGINE}#{victim}", namespace="serve"), no_restart=True)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            failed_within = time.monotonic() - killed
            # Requests sent after the kill, with every kind of routing key: all succeed.
            later = await asyncio.gather(*(ask(client, conversation(100 + i), stream=i % 2 == 0) for i in range(10)))
            return victim, old_ids, results, failed_within, later

    victim, old_ids, results, failed_within, later = asyncio.run(run())
    failed = [r for r in results if r[0] != "ok"]
    assert failed and len(failed) < len(results), results  # the victim's requests, not the others'
    for r in failed:
        assert r[0] in ("status", "stream_error"), r
        if r[0] == "status":
            assert 500 <= r[1] < 600
        else:  # the ingress's error event (then [DONE]), not a silent stop
            assert r[1] == "APIError" and "replica serving this request" in r[2], r
    assert failed_within < 60
    assert all(isinstance(text, str) and text for text in later)
    # Serve is back to two running replicas, and the new one serves requests.
    deadline = time.monotonic() + 180
    while True:
        states = serve.status().applications["default"].deployments[ENGINE].replica_states
        ids = set(metrics("mmkit:request_success_total"))
        if states.get("RUNNING") == 2 and len(ids) == 2 and victim not in ids:
            break
        assert time.monotonic() < deadline, (states, ids)
        time.sleep(1)
    (new,) = ids - old_ids
    before = metrics("mmkit:request_success_total")[new]

    async def spread():
        async with async_client(base_url) as client:
            return await asyncio.gather(*(ask(client, conversation(200 + i), stream=False) for i in range(16)))

    assert all(asyncio.run(spread()))
    assert metrics("mmkit:request_success_total")[new] > before


def wait_for_running_requests(timeout: float = 120) -> dict[str, float]:
    """Each replica's running requests, once both replicas have some."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = metrics("mmkit:num_requests_running")
        if len(running) == 2 and all(n > 0 for n in running.values()):
            return running
        time.sleep(0.2)
    raise AssertionError(f"the replicas never both ran requests: {running}")
