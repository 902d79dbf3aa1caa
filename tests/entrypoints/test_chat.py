"""LLM.chat: every image part type gives the output of the equivalent generate call."""

import base64
import io

import pytest

from conftest import get_llm, make_image
from mmkit import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


def expected(llm, question, images):
    prompt = "USER: " + "<image>\n" * len(images) + question + " ASSISTANT:"
    inputs = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    return llm.generate(inputs, GREEDY, use_tqdm=False)[0]


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_text_only_and_string_content(llm):
    out = llm.chat([{"role": "user", "content": "What is the sea?"}], GREEDY, use_tqdm=False)[0]
    ref = expected(llm, "What is the sea?", [])
    assert out.prompt == ref.prompt and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_each_image_part_type(llm, tmp_path):
    img = make_image(4)
    path = tmp_path / "pic.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data_uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ref = expected(llm, "What is it?", [img])
    text = {"type": "text", "text": "What is it?"}
    for part in ({"type": "image", "image": img},
                 {"type": "image_url", "image_url": {"url": data_uri}},
                 {"type": "image_url", "image_url": {"url": str(path)}},
                 {"type": "image_url", "image_url": {"url": path.as_uri()}}):
        out = llm.chat(user(part, text), GREEDY, use_tqdm=False)[0]
        assert out.prompt == ref.prompt
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_batch_of_conversations_and_multi_turn(llm):
    a, b = make_image(1), make_image(2)
    convs = [user({"type": "image", "image": a}, {"type": "text", "text": "Describe."}),
             user({"type": "image", "image": b}, {"type": "image", "image": a}, {"type": "text", "text": "Compare."}),
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Bye"}]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 3
    assert outs[1].outputs[0].token_ids == expected(llm, "Compare.", [b, a]).outputs[0].token_ids
    assert outs[2].prompt.endswith("USER: Bye ASSISTANT:") and "ASSISTANT: Hello</s>" in outs[2].prompt


def test_custom_template_and_no_generation_prompt(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'][0]['text'] }}\n{% endfor %}"
    out = llm.chat([{"role": "user", "content": "x"}], GREEDY, chat_template=template,
                   add_generation_prompt=False, use_tqdm=False)[0]
    assert out.prompt == "[user] x\n"


@pytest.mark.parametrize("bad,exc,match", [
    ([{"role": "robot", "content": "x"}], ValueError, "role"),
    ([{"content": "x"}], ValueError, "role"),
    (user({"type": "video", "video": 1}), ValueError, "type"),
    (user({"type": "image_url", "image_url": {"url": "/no/such/file.png"}}), ValueError, "file.png"),
    (user({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}), ValueError, "data"),
    (user({"type": "image", "image": "not a PIL image"}), TypeError, "PIL"),
    ([], ValueError, "messages"),
])
def test_bad_messages(llm, bad, exc, match):
    with pytest.raises(exc, match=match):
        llm.chat(bad, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
