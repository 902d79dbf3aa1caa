"""`POST /v1/responses` (stateless) with the official openai client against `LLM.chat` on the
embedded model: one real server subprocess for the whole module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import get_llm
from mmkit import SamplingParams
from mmkit.config import default_model_path
from serve_utils import RED_CIRCLE, ServerProcess, data_uri

MODEL = "default-model"
RED = data_uri(RED_CIRCLE)
QUESTION = "What color is the circle?"
INPUT = [{"role": "user", "content": [{"type": "input_image", "image_url": RED},
                                      {"type": "input_text", "text": QUESTION}]}]
# The same conversation as chat messages (what LLM.chat takes).
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED}},
                                         {"type": "text", "text": QUESTION}]}]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return get_llm(default_model_path())


def reference(llm, messages, **params):
    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


def test_image_input_equals_llm_chat(client, llm):
    r = client.responses.create(model=MODEL, input=INPUT, instructions="Answer briefly.", temperature=0,
                                max_output_tokens=12)
    ref = reference(llm, MESSAGES, temperature=0, max_tokens=12)
    assert r.output_text == ref.outputs[0].text
    assert r.status == ("incomplete" if ref.outputs[0].finish_reason == "length" else "completed")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.instructions
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.usage.input_tokens == len(ref.prompt_token_ids)  # image tokens expanded
    assert r.usage.output_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_string_input_equals_llm_chat(client, llm):
    r = client.responses.create(model=MODEL, input="Describe the image.", temperature=0, max_output_tokens=10)
    ref = reference(llm, [{"role": "user", "content": "Describe the image."}], temperature=0, max_tokens=10)
    assert r.output_text == ref.outputs[0].text


def test_stream_events_in_order_and_deltas_join_to_the_text(client, llm):
    ref = reference(llm, MESSAGES, temperature=0, max_tokens=12)
    events = list(client.responses.create(model=MODEL, input=INPUT, instructions="Answer briefly.",
                                          temperature=0, max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    last = "response.incomplete" if ref.outputs[0].finish_reason == "length" else "response.completed"
    assert types == STREAM_ORDER + ["response.output_text.delta"] * num_deltas + STREAM_END + [last]
    assert num_deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ref.outputs[0].text
    assert events[-4].text == text and events[-3].part.text == text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))


def test_raw_sse_has_event_and_data_lines(server):
    with httpx.stream("POST", server.base_url + "/responses", timeout=120,
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert len(lines) == 2 * len(pairs)
    for event, data in pairs:
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert pairs[0][0] == "event: response.created"


def test_json_schema_text_format_gives_matching_json(client):
    pytest.importorskip("mmkit.structured_outputs.openai")
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=INPUT, temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"color"} and json.loads(r.output_text)["color"] in ("red", "blue")
    assert r.text.format.type == "json_schema"


def test_max_output_tokens_cut_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story.", temperature=0, max_output_tokens=2,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Write a long story.", temperature=0,
                                          max_output_tokens=2, stream=True, extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


BAD = {
    "no input": ({}, "input"),
    "empty input": ({"input": []}, "input"),
    "input not a string or list": ({"input": 3}, "input"),
    "chat-style image part": ({"input": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": RED}}]}]}, "input[0].content[0].type"),
    "image_url not a string": ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": {"url": RED}}]}]},
        "input[0].content[1].image_url"),
    "bad data URI": ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,xx"}]}]}, "input[0].content[0]"),
    "unknown role": ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    "tool item": ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    "previous_response_id": ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    "text.format without a name": ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
                                   "text.format.name"),
    "text.format type": ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    "max_output_tokens 0": ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_naming_the_field(server, case):
    body, param = BAD[case]
    r = httpx.post(server.base_url + "/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert error["type"] == "invalid_request_error"


def test_client_errors_unknown_fields_and_no_stored_responses(server, client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_abc")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other-model", input="hi")
    with pytest.raises(openai.NotFoundError, match="stateless"):
        client.responses.retrieve("resp_abc")
    # Unknown fields are ignored, as on the chat endpoint; `store` is accepted and nothing is kept.
    r = httpx.post(server.base_url + "/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": True,
                         "frobnicate": 1, "metadata": {"a": "b"}, "tools": []})
    assert r.status_code == 200 and r.json()["object"] == "response" and r.json()["store"] is False


def test_route_in_openapi_schema():
    from mmkit.entrypoints.openai.api_server import create_app
    from mmkit.entrypoints.openai.serving_engine import ServerConfig

    app = create_app(object(), ServerConfig(("m",), 512), enable_ui=False)  # routes only: no engine call
    assert "/v1/responses" in app.openapi()["paths"]
    body = app.openapi()["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "max_output_tokens", "text", "temperature", "stream"} <= set(body)
