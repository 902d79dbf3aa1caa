"""`mmkit serve` with the official openai client (sync and async) against `LLM.chat` /
`LLM.generate` on the embedded model: one real server subprocess for the whole module."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from conftest import get_llm
from mmkit import SamplingParams
from mmkit.config import default_model_path
from mmkit.eval.scenes import draw_shape
from serve_utils import RED_CIRCLE, ServerProcess, data_uri, image_message, parse_events, sse_events, wait_until_idle

MODEL = "default-model"
RED = data_uri(RED_CIRCLE)


@pytest.fixture(scope="module")
def server():
    # A small KV cache (96 blocks of 16 tokens): the 100 concurrent requests queue and get preempted.
    proc = ServerProcess("--num-gpu-blocks-override", "96")
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return get_llm(default_model_path())


def conversations():
    blue = data_uri(draw_shape("square", "blue", (160, 120)))
    return [
        image_message(RED, "What color is the circle?"),
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED}},
                                      {"type": "image_url", "image_url": {"url": blue}},
                                      {"type": "text", "text": "Describe the image."}]},
         {"role": "assistant", "content": "a red circle"},
         {"role": "user", "content": "What shape is this?"}],
        [{"role": "user", "content": "Describe the image."}],
    ]


def reference(llm, messages, **params):
    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


def test_colour_question_with_a_data_uri(client):
    r = client.chat.completions.create(model=MODEL, messages=image_message(RED, "What color is the circle?"),
                                       temperature=0, max_tokens=8)
    assert "red" in r.choices[0].message.content.lower()
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


@pytest.mark.parametrize("index", range(3))
def test_greedy_text_and_usage_equal_llm_chat(client, llm, index):
    messages = conversations()[index]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    ref = reference(llm, messages, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # image tokens expanded
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_async_client_concurrent_requests_equal_llm_chat(server, llm):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(
                aclient.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=12,
                                                max_completion_tokens=10)
                for m in conversations()))

    for r, messages in zip(asyncio.run(run()), conversations()):
        ref = reference(llm, messages, temperature=0, max_tokens=10)  # max_completion_tokens wins
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def check_stream_rules(chunks, n):
    """Role in each choice's first delta only; finish_reason exactly once, in its last chunk."""
    per_choice = {i: [c for c in chunks if c.choices and c.choices[0].index == i] for i in range(n)}
    assert all(len(c.choices) <= 1 for c in chunks)
    texts = {}
    for i, own in per_choice.items():
        assert own and own[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.role is None for c in own[1:])
        finished = [c for c in own if c.choices[0].finish_reason is not None]
        assert len(finished) == 1 and finished[0] is own[-1]
        texts[i] = "".join(c.choices[0].delta.content or "" for c in own)
    return texts, own[-1].choices[0].finish_reason


def test_streaming_chunks_follow_the_rules_and_join_to_the_text(client):
    messages = conversations()[1]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, reason = check_stream_rules(chunks, 1)
    assert texts[0] == whole.choices[0].message.content and reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    # Without include_usage: no usage chunk.
    plain = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                                stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_raw_sse_stream_ends_with_done(server):
    body = {"model": MODEL, "messages": conversations()[0], "temperature": 0, "max_tokens": 6, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    chunks = parse_events(events)
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "role" not in chunks[-1]["choices"][0]["delta"]


def test_n2_with_seed_is_reproducible_and_equals_llm_chat(client, llm):
    messages = conversations()[0]
    kwargs = dict(model=MODEL, messages=messages, n=2, seed=7, temperature=1.0, max_tokens=10)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    ref = reference(llm, messages, n=2, seed=7, temperature=1.0, max_tokens=10)
    assert [c.message.content for c in first.choices] == [c.text for c in ref.outputs]
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    texts, _ = check_stream_rules(chunks, 2)
    assert [texts[0], texts[1]] == [c.message.content for c in first.choices]


def test_logprobs_and_top_logprobs(client, llm):
    messages = conversations()[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    ref = reference(llm, messages, temperature=0, max_tokens=8, logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    for entry, token_id, position in zip(content, ref.outputs[0].token_ids, ref.outputs[0].logprobs):
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token ranks first
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode() == entry.token
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                   logprobs=True, top_logprobs=3, stream=True))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completions_equal_llm_generate(client, llm):
    tokenizer = llm.get_tokenizer()
    prompts = ["USER: Describe the image. ASSISTANT:", "USER: Is there a triangle? ASSISTANT:"]
    params = SamplingParams(temperature=0, max_tokens=10)
    refs = llm.generate(prompts, params, use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=10)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in refs)
    ids = tokenizer(prompts[0]).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=10, logprobs=1)
    ref_ids = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert by_ids.choices[0].text == ref_ids.outputs[0].text
    assert by_ids.usage.completion_tokens == len(ref_ids.outputs[0].token_ids)
    assert "".join(by_ids.choices[0].logprobs.tokens) == tokenizer.decode(ref_ids.outputs[0].token_ids)
    two_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:-1]], temperature=0, max_tokens=10)
    assert two_lists.choices[0].text == ref_ids.outputs[0].text and len(two_lists.choices) == 2
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=10,
                                              stream=True, stream_options={"include_usage": True}))
    for i, ref in enumerate(refs):
        own = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in own) == ref.outputs[0].text
        assert [c.finish_reason for c in own if c.finish_reason] == [ref.outputs[0].finish_reason]
    assert streamed[-1].usage == r.usage


def test_100_concurrent_streams_equal_greedy_alone_then_all_blocks_free(server, llm):
    colors = ["red", "blue", "green", "yellow", "purple", "orange"]
    shapes = ["circle", "square", "triangle"]
    questions = ["What color is the shape?", "What shape is this?", "Describe the image.", "Is there a circle?"]
    requests = []
    for i in range(100):
        if i % 2 == 0:
            img = draw_shape(shapes[i % 3], colors[(i // 2) % 6], (96 + i, 96), radius=20 + i % 7)
            requests.append(image_message(data_uri(img), questions[i % 4]))
        else:
            requests.append([{"role": "user", "content": f"{questions[i % 4]} Number {i}."}])
    refs = [reference(llm, m, temperature=0, max_tokens=8).outputs[0].text for m in requests]  # each alone

    async def one(aclient, messages):
        stream = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                       max_tokens=8, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as aclient:
            return await asyncio.gather(*(one(aclient, m) for m in requests))

    assert asyncio.run(run()) == refs
    metrics = wait_until_idle(server.url)
    assert metrics["mmkit:num_requests_running"] == 0 and metrics["mmkit:num_requests_waiting"] == 0
    assert metrics["mmkit:kv_blocks_used"] == 0 and metrics["mmkit:kv_blocks_total"] > 0
    assert metrics["mmkit:kv_blocks_total"] == 96
    assert metrics["mmkit:time_to_first_token_seconds_count"] >= 100
    assert metrics["mmkit:request_queue_time_seconds_count"] >= 100
    # Engine-side first-token times fall inside the HTTP requests' end-to-end latencies.
    assert 0 < metrics["mmkit:time_to_first_token_seconds_sum"] <= metrics["mmkit:e2e_request_latency_seconds_sum"]
    print(f"preemptions so far: {metrics['mmkit:num_preemptions_total']:.0f}")


def test_structured_outputs_through_the_server(client):
    """response_format / structured_outputs reach the engine (once structured outputs exist there)."""
    pytest.importorskip("mmkit.structured_outputs.openai")
    pytest.importorskip("xgrammar")
    messages = image_message(RED, "What color is the circle?")
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                       extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert r.choices[0].message.content in ("blue", "green")
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "blue")


def test_tokenize_and_detokenize(server, llm):
    messages = conversations()[1]
    ref = reference(llm, messages, temperature=0, max_tokens=1)
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert r["tokens"] == ref.prompt_token_ids and r["count"] == len(ref.prompt_token_ids)  # images expanded
    assert r["max_model_len"] == llm.llm_engine.config.scheduler.max_model_len
    text = "USER: Describe the image. ASSISTANT:"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert ids == llm.get_tokenizer()(text).input_ids
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == llm.get_tokenizer().decode(ids)
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(server.url + "/tokenize", json={"model": MODEL})
    assert neither.status_code == 400
