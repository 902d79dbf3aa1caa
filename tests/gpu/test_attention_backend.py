"""The attention-backend selector and the "flex" backend driven by the engine on CPU (eager
FlexAttention: the same metadata and mods the CUDA kernel reads) against the CPU kernels and
transformers' greedy ids."""

from __future__ import annotations

import pytest
import torch

from conftest import get_llm, hf_greedy, make_image
from mmkit import LLM, EngineArgs, SamplingParams
from mmkit.layers.attention_backend import available_backends, select_attention_backend
from mmkit.testing import build_tiny_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_torch_on_cpu_and_flex_on_cuda():
    assert select_attention_backend(CPU) == "torch"
    assert select_attention_backend(CUDA) == "flex"
    assert select_attention_backend(CPU, "flex") == "flex"
    assert "torch" in available_backends(CPU) and "flex" in available_backends(CPU)
    # FlexAttention's Triton tiles need a power-of-two block of at least 16 tokens.
    assert select_attention_backend(CUDA, "auto", block_size=8) == "torch"
    assert select_attention_backend(CPU, "flex", block_size=8) == "flex"  # eager on CPU: any size
    with pytest.raises(ValueError, match="'flex' on CUDA needs block_size a power of two >= 16; got block_size=24"):
        select_attention_backend(CUDA, "flex", block_size=24)


def test_unknown_and_unavailable_backends_are_named():
    with pytest.raises(ValueError, match=r"attention_backend: got 'xformers'; expected one of \['auto', 'torch'"):
        select_attention_backend(CPU, "xformers")
    with pytest.raises(ValueError, match="'flashinfer' runs on CUDA only; device is 'cpu'"):
        select_attention_backend(CPU, "flashinfer")
    with pytest.raises(ValueError, match="'flash_attn' is (not installed|installed but mmkit does not drive it)"):
        select_attention_backend(CUDA, "flash_attn")
    with pytest.raises(ValueError, match="attention_backend: got 'fast'"):
        EngineArgs(attention_backend="fast").create_engine_config()
    with pytest.raises(TypeError, match="enforce_eager: got str; expected bool"):
        EngineArgs(enforce_eager="yes").create_engine_config()


def test_flex_engine_equals_transformers_greedy(gqa_tied_ckpt):
    """Mixed batch (image + text), chunked prefill over a prefix hit, GQA: the flex backend's ids
    equal transformers'."""
    llm = get_llm(gqa_tied_ckpt, attention_backend="flex", num_kv_blocks=48, max_num_batched_tokens=32)
    assert llm.llm_engine.model_runner.attention_backend == "flex"
    img = make_image(6)
    inputs = [{"prompt": PROMPT, "multi_modal_data": {"image": img}}, "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(inputs, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(gqa_tied_ckpt, prompt=PROMPT, images=img, max_new_tokens=12)
    again = llm.generate(inputs[:1], params, use_tqdm=False)  # a prefix-cache hit, then chunks
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    torch_path = get_llm(gqa_tied_ckpt, num_kv_blocks=48, max_num_batched_tokens=32).generate(
        inputs[1:], params, use_tqdm=False)
    assert torch_path[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_flex_engine_sliding_window_and_spans_equal_cpu_path(tmp_path):
    """Gemma 3 shape: 16-token sliding layers next to a global one, bidirectional image spans,
    prompts past the window, chunked: flex equals the CPU kernels' ids."""
    path = build_tiny_checkpoint("Gemma3ForConditionalGeneration", tmp_path / "g3", seed=5, sliding_window=16)
    turn = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    filler = " the quick brown fox jumps over the lazy dog" * 2
    inputs = [{"prompt": turn.format(f"<start_of_image>{filler} What is it?"), "multi_modal_data": {"image": make_image(1)}},
              {"prompt": turn.format(f"{filler} Now look: <start_of_image>What?"), "multi_modal_data": {"image": make_image(2)}}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = {}
    for backend in ("torch", "flex"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=40, block_size=8,
                  max_num_batched_tokens=24)
        ids[backend] = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert ids["flex"] == ids["torch"]


@pytest.mark.cuda
def test_flex_is_the_cuda_default_and_matches_transformers(gqa_tied_ckpt):
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = get_llm(gqa_tied_ckpt, "cuda")
    assert llm.llm_engine.model_runner.attention_backend == "flex"
    img = make_image(6)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(gqa_tied_ckpt, prompt=PROMPT, images=img, max_new_tokens=24)
