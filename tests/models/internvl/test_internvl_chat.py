"""InternVL through `LLM.chat` and `mmkit serve` with the checkpoint's chat template: the prompt
is the template's rendering, the ids are transformers' for it (float32)."""

import openai
import pytest
import torch

from conftest import _hf_model, make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from serve_utils import ServerProcess, data_uri, image_message

IMAGE = make_image(7, 72, 40)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("InternVLForConditionalGeneration", tmp_path_factory.mktemp("ivl"), seed=5)


def test_chat_renders_the_template_and_equals_transformers(ckpt):
    messages = image_message(data_uri(IMAGE), "What is in the image?")
    llm = LLM(str(ckpt), dtype="float32")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    model, processor = _hf_model(str(ckpt))
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    prompt = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    assert out.prompt == prompt == "<|im_start|>user\n<IMG_CONTEXT>\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=prompt, images=IMAGE, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=32, do_sample=False)  # both stop at </s>
    assert out.outputs[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(out.outputs[0].token_ids) == 32  # this seed runs to max_tokens


def test_serve_chat_completion_equals_llm_chat(ckpt):
    messages = image_message(data_uri(IMAGE), "Describe it.")
    expected = LLM(str(ckpt), dtype="float32").chat(messages, SamplingParams(temperature=0, max_tokens=12),
                                                    use_tqdm=False)[0].outputs[0].text
    server = ServerProcess("--model", str(ckpt), "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
        assert reply.choices[0].message.content == expected
    finally:
        assert server.stop() == 0, server.output()[-3000:]
