"""Qwen3.5 through `LLM.chat` and `mmkit serve`: the checkpoint's chat template renders the
prompt, the ids are transformers' (float32), and an OpenAI chat completion with the same image
gives the same text (the hybrid state cache behind the server's `AsyncLLMEngine`)."""

import openai
import pytest
import torch

from conftest import make_image
from qwen_ref import hf_inputs, hf_qwen
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from serve_utils import ServerProcess, data_uri, image_message

IMAGE = make_image(8, 64, 48)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("Qwen3_5ForConditionalGeneration", tmp_path_factory.mktemp("q35chat"), seed=5)


def test_chat_and_serve_equal_transformers(ckpt):
    messages = image_message(data_uri(IMAGE), "Describe it.")
    out = LLM(str(ckpt), dtype="float32").chat(messages, SamplingParams(temperature=0, max_tokens=12),
                                               use_tqdm=False)[0]
    model, processor = hf_qwen(str(ckpt))
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == prompt
    inputs = hf_inputs(ckpt, prompt, [IMAGE])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert list(out.outputs[0].token_ids) == ref[0, inputs["input_ids"].shape[1]:].tolist()
    server = ServerProcess("--model", str(ckpt), "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=12)
        assert reply.choices[0].message.content == out.outputs[0].text
    finally:
        assert server.stop() == 0, server.output()[-3000:]
