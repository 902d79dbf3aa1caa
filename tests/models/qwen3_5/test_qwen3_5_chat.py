"""Qwen3.5 through `LLM.chat` and `mmkit serve`: the checkpoint's chat template renders the
prompt, the ids are transformers' (float32), and an OpenAI chat completion with the same image
gives the same text (the hybrid state cache behind the server's `AsyncLLMEngine`)."""

import pytest

from conftest import make_image
from mmkit.testing import build_tiny_checkpoint
from qwen_ref import assert_chat_and_serve_equal_transformers

IMAGE = make_image(8, 64, 48)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("Qwen3_5ForConditionalGeneration", tmp_path_factory.mktemp("q35chat"), seed=5)


def test_chat_and_serve_equal_transformers(ckpt):
    assert_chat_and_serve_equal_transformers(ckpt, IMAGE)
