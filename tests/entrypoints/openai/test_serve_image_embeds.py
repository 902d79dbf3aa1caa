"""vLLM's `image_embeds` chat part through `/v1/chat/completions`: the base64 of `torch.save` of
the embedded model's own rows for an image answers as the image does, and as `LLM.chat` does
on the same part; a part of the wrong shape is a 400 naming it."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from conftest import get_llm
from mmkit import SamplingParams
from mmkit.config import default_model_path
from mmkit.multimodal.image_io import load_image
from mmkit.multimodal.parse import parse_inputs
from serve_utils import RED_CIRCLE, ServerProcess, data_uri

QUESTION = {"type": "text", "text": "What is in the image?"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def llm():
    return get_llm(default_model_path())


def _b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def own_rows(llm, image) -> torch.Tensor:
    """The model's own embedding rows for `image`: [image_seq_length, hidden]."""
    proc, model = llm.llm_engine.input_processor, llm.llm_engine.model_runner.model
    parsed = parse_inputs({"prompt": "USER: <image>\nHi ASSISTANT:", "multi_modal_data": {"image": image}})[0]
    item = proc.process(parsed).images[0]
    with torch.no_grad():
        return model.embed_multimodal([proc.mm_item_inputs(item)])[0]


def test_image_embeds_part_answers_as_the_image(server, llm):
    image = load_image(str(RED_CIRCLE), where="test")
    part = {"type": "image_embeds", "image_embeds": _b64(own_rows(llm, image))}
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": image}, QUESTION]}], params,
                        use_tqdm=False)[0].outputs[0].text
    assert llm.chat([{"role": "user", "content": [part, QUESTION]}], params,
                    use_tqdm=False)[0].outputs[0].text == expected
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="default-model", temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": [part, QUESTION]}])
    assert reply.choices[0].message.content == expected
    # the same image as a data URI, for good measure
    by_uri = client.chat.completions.create(model="default-model", temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(RED_CIRCLE)}}, QUESTION]}])
    assert by_uri.choices[0].message.content == expected
    bad = {"type": "image_embeds", "image_embeds": _b64(own_rows(llm, image)[:, :-1])}
    with pytest.raises(openai.BadRequestError, match=r"image embeddings of shape"):
        client.chat.completions.create(model="default-model", temperature=0, max_tokens=4,
                                       messages=[{"role": "user", "content": [bad, QUESTION]}])
