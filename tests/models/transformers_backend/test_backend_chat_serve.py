"""The backend behind `LLM.chat` and `mmkit serve --model-impl transformers`: the chat template's
prompt, transformers' ids for it, and the server's answer equal to LLM.chat's."""

import openai
import torch

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.backend_parity import TransformersReference
from serve_utils import ServerProcess, data_uri, image_message

IMAGE = make_image(9, 64, 48)


def test_chat_and_serve_run_on_the_backend(tmp_path):
    ckpt = build_tiny_checkpoint("Qwen2VLForConditionalGeneration", tmp_path / "qwen", seed=6)
    messages = image_message(data_uri(IMAGE), "What is in the image?")
    llm = LLM(str(ckpt), dtype="float32", model_impl="transformers")
    assert type(llm.llm_engine.model_runner.model).__name__ == "TransformersBackendModel"
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ref = TransformersReference(str(ckpt))
    inputs = ref.processor(text=[out.prompt], images=[IMAGE], return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = ref.model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()

    expected = out.outputs[0].text
    server = ServerProcess("--model", str(ckpt), "--dtype", "float32", "--model-impl", "transformers")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected
    finally:
        assert server.stop() == 0, server.output()[-3000:]
