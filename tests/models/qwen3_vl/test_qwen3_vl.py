"""Qwen3-VL (dense) and Qwen3-VL-MoE on tiny random checkpoints built with transformers' own
classes and processor: greedy ids equal transformers' (float32) for a mixed batch (text, one
image, two images of different sizes, a timestamped video, image + video, token-id prompts,
32 new tokens), under chunked prefill splitting an image, forced preemption, a prefix-cache hit,
per-request / engine mm_processor_kwargs, and in the hub layout; bad inputs fail up front."""

from __future__ import annotations

import json
import pytest
import torch

from conftest import make_image
from qwen_ref import P_2IMG, P_IMG, P_IMG_VID, P_VID, hf_inputs, hf_qwen
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.qwen3_vl import rewrite_qwen3_hub_layout

N = 32
IMG1, IMG2, IMG3 = make_image(1, 60, 40), make_image(2, 30, 50), make_image(3, 90, 33)
FRAMES = [make_image(10 + i, 48, 32) for i in range(8)]  # 8 frames at 24 fps, sampled at 12 -> 4


@pytest.fixture(scope="module", params=["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"])
def ckpt(request, tmp_path_factory):
    return build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param[:9]), seed=1)


def greedy(max_tokens=N, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


_REFS: dict = {}


def hf_greedy(path, prompt, images=None, videos=None, mm_kwargs=None, input_ids=None) -> list[int]:
    """transformers' greedy ids, exactly N tokens (mmkit runs with ignore_eos)."""
    key = (str(path), prompt, id(images), id(videos), json.dumps(mm_kwargs), tuple(input_ids or ()))
    if key not in _REFS:
        model, _ = hf_qwen(str(path))
        if input_ids is not None:
            inputs = {"input_ids": torch.tensor([input_ids]), "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
        else:
            inputs = hf_inputs(path, prompt, images, videos, mm_kwargs)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        _REFS[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
    return _REFS[key]


def cases(tokenizer):
    """(mmkit input, reference kwargs) for the mixed batch."""
    text_ids = tokenizer("Write a haiku about the sea.").input_ids
    img_ids = tokenizer(P_IMG).input_ids  # one <|image_pad|>: mmkit expands it
    return [
        ("Write a haiku about the sea.", dict(prompt="Write a haiku about the sea.")),
        ({"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, dict(prompt=P_IMG, images=[IMG1])),
        ({"prompt": P_2IMG, "multi_modal_data": {"image": [IMG2, IMG3]}}, dict(prompt=P_2IMG, images=[IMG2, IMG3])),
        ({"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}, dict(prompt=P_VID, videos=FRAMES)),
        ({"prompt": P_IMG_VID, "multi_modal_data": {"image": IMG3, "video": FRAMES[:6]}},
         dict(prompt=P_IMG_VID, images=[IMG3], videos=FRAMES[:6])),
        ({"prompt_token_ids": text_ids}, dict(prompt=None, input_ids=text_ids)),
        ({"prompt_token_ids": img_ids, "multi_modal_data": {"image": IMG1}}, dict(prompt=P_IMG, images=[IMG1])),
    ]


def check_batch(llm, path, selected=None):
    batch = cases(llm.get_tokenizer())
    batch = [batch[i] for i in selected] if selected else batch
    outs = llm.generate([inp for inp, _ in batch], greedy(), use_tqdm=False)
    for out, (_, ref) in zip(outs, batch):
        assert list(out.outputs[0].token_ids) == hf_greedy(path, **ref), ref
    return outs


def test_mixed_batch_equals_transformers(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    assert llm.llm_engine.config.model.capabilities.deepstack_num_layers == 2
    outs = check_batch(llm, ckpt)
    # The prompt as transformers' processor expands it, timestamps included.
    video_ids = hf_inputs(ckpt, P_VID, videos=FRAMES)["input_ids"][0].tolist()
    assert list(outs[3].prompt_token_ids) == video_ids
    assert "<0.2 seconds>" in llm.get_tokenizer().decode(video_ids)


def test_chunked_prefill_preemption_and_prefix_cache(ckpt):
    # 8-token chunks split every image's placeholder run (16 tokens for IMG1) and the video's.
    check_batch(LLM(str(ckpt), dtype="float32", max_num_batched_tokens=8), ckpt, [1, 2, 3])
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=12, block_size=16)
    check_batch(llm, ckpt, [0, 1, 2, 4])
    assert llm.get_metrics()["num_preemptions"] >= 1
    llm = LLM(str(ckpt), dtype="float32", block_size=4)
    q2 = P_IMG.replace("What is in the image?", "Describe it in one word.")
    first = llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, greedy(), use_tqdm=False)
    before = llm.get_metrics()
    second = llm.generate({"prompt": q2, "multi_modal_data": {"image": IMG1}}, greedy(), use_tqdm=False)
    after = llm.get_metrics()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]  # DeepStack features cached too
    assert first[0].outputs[0].token_ids == hf_greedy(ckpt, P_IMG, images=[IMG1])
    assert second[0].outputs[0].token_ids == hf_greedy(ckpt, q2, images=[IMG1])


def test_mm_processor_kwargs_resolution_and_video_sampling(ckpt):
    small = {"max_pixels": 16 * 16 * 4}
    llm = LLM(str(ckpt), dtype="float32")
    big_in = {"prompt": P_IMG, "multi_modal_data": {"image": IMG3}}
    video = {"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}
    outs = llm.generate([big_in, {**big_in, "mm_processor_kwargs": small}, video,
                         {**video, "mm_processor_kwargs": {"fps": 24}}], greedy(), use_tqdm=False)
    assert len(outs[0].prompt_token_ids) > len(outs[1].prompt_token_ids)
    assert len(outs[3].prompt_token_ids) > len(outs[2].prompt_token_ids)  # 8 frames sampled, not 4
    assert outs[1].outputs[0].token_ids == hf_greedy(ckpt, P_IMG, images=[IMG3], mm_kwargs=small)
    assert list(outs[3].prompt_token_ids) == hf_inputs(ckpt, P_VID, videos=FRAMES, mm_kwargs={"fps": 24})["input_ids"][0].tolist()
    assert outs[3].outputs[0].token_ids == hf_greedy(ckpt, P_VID, videos=FRAMES, mm_kwargs={"fps": 24})
    assert llm.get_metrics()["encoder_cache_misses"] == 4  # options are part of the cache keys
    engine_small = LLM(str(ckpt), dtype="float32", mm_processor_kwargs=small)
    again = engine_small.generate(big_in, greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_hub_layout_gives_transformers_ids(ckpt, tmp_path):
    hub = rewrite_qwen3_hub_layout(ckpt, tmp_path / "hub")
    llm = LLM(str(hub), dtype="float32")
    check_batch(llm, hub, [1, 3])


def test_bad_inputs_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32", limit_mm_per_prompt={"image": 2, "video": 1})
    ok = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"prompt": P_2IMG + P_IMG, "multi_modal_data": {"image": [IMG1, IMG2, IMG3]}}, ValueError,
         r"inputs\[1\].*3 images.*limit_mm_per_prompt\['image'\] = 2"),
        ({**ok, "mm_processor_kwargs": {"max_pixel": 100}}, ValueError,
         r"inputs\[1\]\.mm_processor_kwargs: unknown key\(s\) \['max_pixel'\]"),
        ({"prompt": P_VID, "multi_modal_data": {"video": torch.zeros(32, 32)}}, ValueError, r"inputs\[1\].*shape \(32, 32\)"),
        ({"prompt": P_VID, "multi_modal_data": {"video": [FRAMES[0]]}}, ValueError,
         r"inputs\[1\]\.multi_modal_data\.video\[0\]: got a 1-frame 48x32 video"),
    ]
    for item, exc, match in bad:
        with pytest.raises(exc, match=match):
            llm.generate([ok, item], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_chat_uses_the_checkpoint_template(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    messages = [{"role": "user", "content": [{"type": "video", "video": FRAMES},
                                             {"type": "text", "text": "Describe this video."}]}]
    out = llm.chat(messages, greedy(8), use_tqdm=False)[0]
    _, processor = hf_qwen(str(ckpt))
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(out.prompt_token_ids) == hf_inputs(ckpt, prompt, videos=FRAMES)["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_greedy(ckpt, prompt, videos=FRAMES)[:8]


def test_bf16_agrees_with_transformers_bf16(ckpt):
    """bf16 (C kernels on CPU, experts in bf16) against transformers' own bf16 generate: equal
    ids up to the first step where transformers' own top-2 bf16 logits are a near-tie (within
    two bf16 ulps), where equally valid rounding may pick either."""
    llm = LLM(str(ckpt), dtype="bfloat16")
    model, _ = hf_qwen(str(ckpt), torch.bfloat16)
    for prompt, images in [("Write a haiku about the sea.", None), (P_IMG, [IMG1])]:
        inp = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
        got = list(llm.generate(inp, greedy(16), use_tqdm=False)[0].outputs[0].token_ids)
        ref_in = hf_inputs(ckpt, prompt, images)
        with torch.no_grad():
            ref = model.generate(**ref_in, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        want = ref.sequences[0, ref_in["input_ids"].shape[1]:].tolist()
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is not None:
            top = ref.scores[first][0].float().topk(2).values
            ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)
            assert top[0] - top[1] <= 2 * ulp, (prompt, first, top.tolist())
