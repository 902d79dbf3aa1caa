"""Qwen3-VL through `mmkit serve` with the checkpoint's chat template: an OpenAI chat completion
with an image gives the text `LLM.chat` gives for the same messages, whose prompt is the
template's rendering and whose ids are transformers' (float32)."""

import pytest

from conftest import make_image
from mmkit.testing import build_tiny_checkpoint
from qwen_ref import assert_chat_and_serve_equal_transformers

IMAGE = make_image(7, 72, 40)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("Qwen3VLForConditionalGeneration", tmp_path_factory.mktemp("q3chat"), seed=5)


def test_serve_chat_completion_equals_llm_chat_and_transformers(ckpt):
    assert_chat_and_serve_equal_transformers(ckpt, IMAGE)
