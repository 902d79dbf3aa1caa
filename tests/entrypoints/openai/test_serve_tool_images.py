"""Images inside tool results: an assistant turn with `tool_calls` (content None) and `role: "tool"`
messages whose content holds image parts, through `LLM.chat` and `/v1/chat/completions`; the
prompt is transformers' `apply_chat_template` rendering of the same messages, images in order."""

from __future__ import annotations

import copy

import openai
import pytest
from transformers import AutoProcessor

from conftest import get_llm
from mmkit import SamplingParams
from mmkit.config import default_model_path
from mmkit.eval.scenes import draw_shape
from mmkit.multimodal.image_io import load_image
from serve_utils import RED_CIRCLE, ServerProcess, data_uri

RED = data_uri(RED_CIRCLE)
BLUE_IMAGE = draw_shape("square", "blue", (160, 120))
BLUE = data_uri(BLUE_IMAGE)

# A tool-calling template in the style of Qwen3-VL's (tool results wrapped in <tool_response>,
# consecutive tool messages in one user turn, images inside them), with LLaVA's <image>.
TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}USER:{% endif %}"
    " <tool_response id={{ message.tool_call_id }}>"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for c in message.content %}"
    "{%- if c.type == 'image' %}<image>\n{% elif c.type == 'text' %}{{ c.text }}{% endif %}{%- endfor %}{%- endif %}"
    "</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %} {% endif %}"
    "{%- elif message.role == 'assistant' %}ASSISTANT: "
    "{%- if message.content is string %}{{ message.content }}{% elif message.content %}"
    "{% for c in message.content %}{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments }}}</tool_call>{% endfor %}{{ eos_token }}"
    "{%- else %}{{ message.role.upper() }}: {% if message.content is string %}{{ message.content }}{% else %}"
    "{% for c in message.content %}{% if c.type == 'image' %}<image>\n{% elif c.type == 'text' %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %} {% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_chat() -> list[dict]:
    """A user image (blue), a tool call, two tool results (an image, red; then text), a question."""
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": BLUE}},
                                     {"type": "text", "text": "Compare this with the reference picture."}]},
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_1", "get_reference", '{"name": "red"}'), call("call_2", "get_caption", "{}")]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": [{"type": "image_url", "image_url": {"url": RED}}, {"type": "text", "text": "The reference."}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "A red circle on white."},
    ]


@pytest.fixture(scope="module")
def llm():
    return get_llm(default_model_path())


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tool_template") / "tool.jinja"
    template.write_text(TOOL_TEMPLATE)
    proc = ServerProcess("--chat-template", str(template))
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE], ids=["checkpoint-template", "tool-template"])
def test_llm_chat_prompt_is_transformers_rendering_images_in_order(llm, processor, template):
    messages = tool_chat()
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    out = llm.chat(copy.deepcopy(messages), params, chat_template=template, use_tqdm=False)[0]
    prompt = processor.apply_chat_template(copy.deepcopy(messages), chat_template=template,
                                           add_generation_prompt=True, tokenize=False)
    assert out.prompt == prompt
    assert prompt.count("<image>") == 2
    if template is not None:
        assert '<tool_call>{"name": "get_reference", "arguments": {"name": "red"}}</tool_call>' in prompt
        assert "<tool_response id=call_2>A red circle on white.</tool_response>" in prompt
    # Images in order of appearance: the user's (blue) first, then the tool's (red); the
    # log-probabilities tell the two orders apart even where the greedy text does not.
    red = load_image(RED, where="red")
    in_order, swapped = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}
                                      for images in ([BLUE_IMAGE, red], [red, BLUE_IMAGE])], params, use_tqdm=False)
    assert in_order.prompt_token_ids == out.prompt_token_ids
    assert in_order.outputs[0].token_ids == out.outputs[0].token_ids
    assert in_order.outputs[0].cumulative_logprob == pytest.approx(out.outputs[0].cumulative_logprob, abs=1e-5)
    assert swapped.outputs[0].cumulative_logprob != pytest.approx(out.outputs[0].cumulative_logprob, abs=1e-3)


def test_server_answers_as_llm_chat(server, llm):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    messages = tool_chat()
    reply = client.chat.completions.create(model="default-model", messages=messages, temperature=0, max_tokens=10)
    ref = llm.chat(copy.deepcopy(messages), greedy(), chat_template=TOOL_TEMPLATE, use_tqdm=False)[0]
    assert reply.choices[0].message.content == ref.outputs[0].text
    assert reply.usage.prompt_tokens == len(ref.prompt_token_ids)  # both images' tokens expanded


def test_bad_tool_messages_are_clear_errors(llm, server):
    bad_calls = tool_chat()[:2]
    bad_calls[1] = {"role": "assistant", "content": None, "tool_calls": "get_reference"}
    with pytest.raises(TypeError, match=r"messages\[0\]\[1\]\.tool_calls"):
        llm.chat(bad_calls, greedy(), use_tqdm=False)
    no_content = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c"}]
    with pytest.raises(ValueError, match=r"messages\[0\]\[1\]: .*expected a dict with 'role' and 'content'"):
        llm.chat(no_content, greedy(), use_tqdm=False)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    bad_image = tool_chat()
    bad_image[2]["content"][0] = {"type": "image_url", "image_url": {"url": "data:image/png;base64,xx"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[2\]\.content\[0\]"):
        client.chat.completions.create(model="default-model", messages=bad_image, max_tokens=2)
