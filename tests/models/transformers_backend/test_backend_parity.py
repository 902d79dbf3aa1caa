"""Two native families run with model_impl="transformers" against transformers' greedy ids
(float32, EOS ignored), through the reusable `assert_backend_parity` (mixed batch, chunked
prefill splitting image spans, forced preemption, prefix-cache hits); the native path is run on
the same cases, so the two implementations check each other."""

from __future__ import annotations

import pytest
from transformers import AutoProcessor

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_llava
from mmkit.testing.backend_parity import ParityCase, TransformersReference, assert_backend_parity
from mmkit.testing.qwen2_vl import build_tiny_qwen2_vl

IMG1, IMG2, IMG3 = make_image(1, 60, 40), make_image(2, 30, 50), make_image(3, 90, 33)


def _cases(path, template: str) -> list[ParityCase]:
    """text only, one image, two images of different sizes, a token-id prompt with an image."""
    processor = AutoProcessor.from_pretrained(path)
    image = processor.image_token
    one = template.format(f"{image}What is it?")
    ids = list(processor.tokenizer(one).input_ids)  # the placeholder once, unexpanded
    return [ParityCase(template.format("Tell me a story."), name="text"),
            ParityCase(one, [IMG1], name="one image"),
            ParityCase(template.format(f"{image} and {image} compared."), [IMG2, IMG3], name="two images"),
            ParityCase(ids, [IMG3], text=one, name="token ids")]


@pytest.fixture(scope="module")
def llava_ckpt(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("backend_llava"), seed=5, num_kv_heads=2)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("backend_qwen"), version="2", seed=4)


LLAVA_TEMPLATE = "USER: {}\nASSISTANT:"
QWEN_TEMPLATE = ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


def _qwen_cases(path):
    cases = _cases(path, QWEN_TEMPLATE)
    # Qwen2-VL's placeholder sits between vision_start / vision_end in its chat format.
    wrap = "<|vision_start|><|image_pad|><|vision_end|>"
    for case in cases:
        if isinstance(case.prompt, str):
            case.prompt = case.prompt.replace("<|image_pad|>", wrap)
        else:
            case.text = case.text.replace("<|image_pad|>", wrap)
            case.prompt = list(AutoProcessor.from_pretrained(path).tokenizer(case.text).input_ids)
    return cases


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_backend_matches_transformers_and_native(family, llava_ckpt, qwen_ckpt):
    path = llava_ckpt if family == "llava" else qwen_ckpt
    cases = _cases(path, LLAVA_TEMPLATE) if family == "llava" else _qwen_cases(path)
    ref = TransformersReference(str(path))
    got = assert_backend_parity(path, cases, model_impl="transformers", reference=ref.greedy, max_tokens=8)
    assert set(got) == {"batch", "prefix", "chunked", "preempt"}
    # The native family on the same cases: the two implementations agree with each other.
    native = assert_backend_parity(path, cases, model_impl="mmkit", reference=ref.greedy, max_tokens=8,
                                   checks=("batch",))
    assert native["batch"] == got["batch"]


def test_backend_expands_prompts_as_the_processor_does(qwen_ckpt):
    cases = _qwen_cases(qwen_ckpt)
    ref = TransformersReference(str(qwen_ckpt))
    llm = LLM(str(qwen_ckpt), dtype="float32", model_impl="transformers")
    assert type(llm.llm_engine.model_runner.model).__name__ == "TransformersBackendModel"
    outs = llm.generate([c.as_input() for c in cases], use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.prompt_token_ids == ref.inputs(case)["input_ids"][0].tolist(), case.name


def test_gemma3_sliding_windows_softcapped_logits_and_bidirectional_image_runs(tmp_path_factory):
    """Gemma 3 through the backend: sliding layers (a window of 8 tokens, shorter than the
    prompts), final logit soft-capping, and image runs attended both ways (its forward's mask)."""
    from mmkit.testing.gemma3 import build_tiny_gemma3

    path = build_tiny_gemma3(tmp_path_factory.mktemp("backend_gemma3"), sliding_window=8, final_logit_softcapping=30.0)
    template = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    cases = [ParityCase(template.format("Tell me a story."), name="text"),
             ParityCase(template.format("<start_of_image>What is it?"), [IMG1], name="one image"),
             ParityCase(template.format("<start_of_image> and <start_of_image> compared."), [IMG2, IMG3],
                        name="two images")]
    ref = TransformersReference(str(path))
    assert_backend_parity(path, cases, reference=ref.greedy, max_tokens=8)


def test_the_masked_attention_path_reads_the_paged_cache_like_the_kernels(llava_ckpt, monkeypatch):
    """The eager path (soft-capping, chunked attention) on every layer, with a chunk longer than
    any sequence (so it computes plain causal attention): the same ids as transformers under
    batching, chunked prefill, preemption and prefix hits."""
    from mmkit.models.transformers_backend import model as backend

    load = backend.TransformersBackendModel.load_checkpoint

    def load_with_chunks(self, *args, **kwargs):
        load(self, *args, **kwargs)
        self.layer_chunk_sizes = (1 << 20,) * self.config.get_text_config().num_hidden_layers

    monkeypatch.setattr(backend.TransformersBackendModel, "load_checkpoint", load_with_chunks)
    calls = []
    masked = backend.attention._masked_attention
    monkeypatch.setattr(backend.attention, "_masked_attention", lambda *a: calls.append(1) or masked(*a))
    cases = _cases(llava_ckpt, LLAVA_TEMPLATE)
    assert_backend_parity(llava_ckpt, cases, reference=TransformersReference(str(llava_ckpt)).greedy, max_tokens=8)
    assert calls


def test_image_features_go_through_the_encoder_cache_keyed_by_content(qwen_ckpt):
    cases = _qwen_cases(qwen_ckpt)
    llm = LLM(str(qwen_ckpt), dtype="float32", model_impl="transformers", enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    greedy = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate([cases[1].as_input()], greedy, use_tqdm=False)
    calls = runner.num_vision_calls
    again = llm.generate([cases[1].as_input()], greedy, use_tqdm=False)  # the same image: no tower call
    assert runner.num_vision_calls == calls and llm.get_metrics()["encoder_cache_hits"] >= 1
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    other = ParityCase(cases[1].prompt, [IMG2])  # another image of the same prompt: encoded
    llm.generate([other.as_input()], greedy, use_tqdm=False)
    assert runner.num_vision_calls == calls + 1
