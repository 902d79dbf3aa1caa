"""Qwen2-VL and Qwen2.5-VL against transformers (float32 greedy ids, processor outputs, M-RoPE)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, make_image, pil_to_tensor
from qwen_ref import P_2IMG, P_IMG, P_IMG_VID, P_VID, hf_inputs, hf_qwen, hf_qwen_greedy
from mmkit.testing.qwen2_vl import build_tiny_qwen2_vl, rewrite_qwen_hub_layout
from mmkit import LLM, SamplingParams

N = 32  # new tokens per request


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen_ckpt(request, tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"qwen{request.param}"), version=request.param, seed=3)


def greedy(max_tokens=N, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


IMG1, IMG2, IMG3 = make_image(1, 60, 40), make_image(2, 30, 50), make_image(3, 90, 33)
FRAMES = [make_image(10 + i, 48, 32) for i in range(4)]


def _cases():
    """(name, mmkit input, reference kwargs)."""
    return [
        ("text", "Write a haiku about the sea.", dict(prompt="Write a haiku about the sea.")),
        ("image", {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, dict(prompt=P_IMG, images=[IMG1])),
        ("two images", {"prompt": P_2IMG, "multi_modal_data": {"image": [IMG2, IMG3]}},
         dict(prompt=P_2IMG, images=[IMG2, IMG3])),
        ("video", {"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}, dict(prompt=P_VID, videos=FRAMES)),
        ("image+video", {"prompt": P_IMG_VID, "multi_modal_data": {"image": IMG3, "video": FRAMES[:3]}},
         dict(prompt=P_IMG_VID, images=[IMG3], videos=FRAMES[:3])),
    ]


def test_mrope_positions_match_transformers(qwen_ckpt):
    """mmkit's M-RoPE rows and delta == transformers' get_rope_index on the processor's output."""
    model, _ = hf_qwen(str(qwen_ckpt))
    llm = LLM(str(qwen_ckpt), dtype="float32", num_kv_blocks=8)
    proc = llm.llm_engine.input_processor
    from mmkit.multimodal.parse import parse_prompt

    for name, mm_input, ref_kwargs in _cases()[1:]:
        ref = hf_inputs(qwen_ckpt, **ref_kwargs)
        extra = {k: ref[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in ref}
        positions, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], **extra)
        processed = proc.process(parse_prompt(0, mm_input))
        assert processed.prompt_token_ids == ref["input_ids"][0].tolist(), name
        assert torch.equal(processed.mrope_positions, positions[:, 0]), name
        assert processed.mrope_position_delta == int(delta), name
    # The interface: a SupportsMultiModal model declaring M-RoPE; its per-image placeholder count
    # (dynamic resolution) is the processor's and the HF processor's.
    from mmkit.models.interfaces import SupportsMultiModal

    mine = llm.llm_engine.model_runner.model
    assert isinstance(mine, SupportsMultiModal) and llm.llm_engine.config.model.capabilities.uses_mrope
    for img in (IMG1, IMG2, IMG3, make_image(7, 300, 20)):
        ref = hf_inputs(qwen_ckpt, P_IMG, [img])
        count = type(mine).get_num_placeholder_tokens(llm.llm_engine.config.model.hf_config, img.size,
                                                      proc.image_processor)
        assert count == int(ref["image_grid_thw"].prod()) // 4 == int((ref["input_ids"] == proc.token_ids["image"]).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_batch_matches_transformers(qwen_ckpt, device):
    """text, one image, two images of different sizes, a video, image+video; token ids; 32 tokens."""
    llm = LLM(str(qwen_ckpt), dtype="float32", device=device)
    cases = _cases()
    refs = [hf_qwen_greedy(qwen_ckpt, **ref) for _, _, ref in cases]
    ids = llm.get_tokenizer()(P_IMG).input_ids  # one <|image_pad|> per image, expanded by mmkit
    inputs = [c[1] for c in cases] + [{"prompt_token_ids": ids, "multi_modal_data": {"image": pil_to_tensor(IMG1)}}]
    outs = llm.generate(inputs, greedy(), use_tqdm=False)
    for (name, _, _), out, ref in zip(cases, outs, refs):
        assert out.outputs[0].token_ids == ref, name
    assert outs[-1].outputs[0].token_ids == refs[1]
    expanded = {"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"image": IMG1}}
    assert llm.generate(expanded, greedy(), use_tqdm=False)[0].outputs[0].token_ids == refs[1]
    # The engine's paths: chunked prefill splitting image runs, preemption by recompute.
    for kwargs in (dict(max_num_batched_tokens=7), dict(num_kv_blocks=16, block_size=8)):
        small = LLM(str(qwen_ckpt), dtype="float32", device=device, **kwargs)
        outs = small.generate(inputs, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs + [refs[1]], kwargs
        if "num_kv_blocks" in kwargs:
            assert small.get_metrics()["num_preemptions"] > 0


def test_prefix_cache_hit_and_n(qwen_ckpt):
    """Same image, second question: the KV of the shared prefix is reused (hit mid-prompt), the
    positions stay right; n=2 forks keep the generation delta."""
    llm = LLM(str(qwen_ckpt), dtype="float32", block_size=4)
    q2 = P_IMG.replace("What is in the image?", "Describe it in one word.")
    first = llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, greedy(), use_tqdm=False)
    before = llm.get_metrics()
    second = llm.generate({"prompt": q2, "multi_modal_data": {"image": IMG1}}, greedy(), use_tqdm=False)
    after = llm.get_metrics()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]  # image not re-encoded
    assert first[0].outputs[0].token_ids == hf_qwen_greedy(qwen_ckpt, P_IMG, images=[IMG1])
    assert second[0].outputs[0].token_ids == hf_qwen_greedy(qwen_ckpt, q2, images=[IMG1])
    forked = llm.generate({"prompt": q2, "multi_modal_data": {"image": IMG1}}, greedy(n=2), use_tqdm=False)
    assert [c.token_ids for c in forked[0].outputs] == [second[0].outputs[0].token_ids] * 2


def test_mm_processor_kwargs_resolution(qwen_ckpt):
    """Per request and engine-wide max_pixels: other token counts, no cache sharing, parity."""
    small = {"max_pixels": 16 * 16 * 4}
    llm = LLM(str(qwen_ckpt), dtype="float32")
    big_in = {"prompt": P_IMG, "multi_modal_data": {"image": IMG3}}
    small_in = {**big_in, "mm_processor_kwargs": small}
    outs = llm.generate([big_in, small_in], greedy(), use_tqdm=False)
    m = llm.get_metrics()
    assert len(outs[0].prompt_token_ids) > len(outs[1].prompt_token_ids)
    assert m["encoder_cache_misses"] == 2 and m["encoder_cache_hits"] == 0
    assert outs[0].outputs[0].token_ids == hf_qwen_greedy(qwen_ckpt, P_IMG, images=[IMG3])
    ref_small = hf_qwen_greedy(qwen_ckpt, P_IMG, images=[IMG3], mm_kwargs=small)
    assert outs[1].outputs[0].token_ids == ref_small
    assert len(outs[1].prompt_token_ids) == hf_inputs(qwen_ckpt, P_IMG, [IMG3], mm_kwargs=small)["input_ids"].shape[1]
    # Engine-wide option; a request's own option overrides it.
    engine_small = LLM(str(qwen_ckpt), dtype="float32", mm_processor_kwargs=small)
    outs2 = engine_small.generate([big_in, {**big_in, "mm_processor_kwargs": {"max_pixels": 16 * 16 * 16}}],
                                  greedy(), use_tqdm=False)
    assert outs2[0].outputs[0].token_ids == ref_small
    assert outs2[1].prompt_token_ids == outs[0].prompt_token_ids
    assert outs2[1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_bad_inputs(qwen_ckpt):
    llm = LLM(str(qwen_ckpt), dtype="float32", limit_mm_per_prompt={"image": 2, "video": 1})
    ok = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"prompt": P_VID, "multi_modal_data": {"video": torch.zeros(3, 32, 32, dtype=torch.uint8)}},
         ValueError, r"inputs\[1\].*video tensor of shape \(3, 32, 32\).*\(T, C, H, W\)"),
        ({"prompt": P_VID, "multi_modal_data": {"video": torch.zeros(32, 32)}}, ValueError, "shape \\(32, 32\\)"),
        ({"prompt": P_VID + P_VID, "multi_modal_data": {"video": [FRAMES, FRAMES]}}, ValueError,
         r"inputs\[1\].*2 videos.*limit_mm_per_prompt\['video'\] = 1"),
        ({**ok, "mm_processor_kwargs": {"max_pixel": 100}}, ValueError,
         r"inputs\[1\]\.mm_processor_kwargs: unknown key\(s\) \['max_pixel'\]"),
        ({**ok, "mm_processor_kwargs": {"max_pixels": -5}}, ValueError, "expected a positive integer"),
        ({"prompt": P_IMG, "multi_modal_data": {"image": [IMG1, IMG2]}}, ValueError,
         r"1 <\|image_pad\|> placeholder\(s\) for 2 image\(s\)"),
        ({"prompt": P_VID, "multi_modal_data": {"video": [FRAMES[0], make_image(5, 20, 20)]}}, ValueError,
         "frames of different sizes"),
        ({"prompt": P_IMG, "multi_modal_data": {"image": make_image(6, 402, 2)}}, ValueError,
         r"inputs\[1\]\.multi_modal_data\.image\[0\]: got a 402x2 image: absolute aspect ratio must be smaller than 200"),
        ({"prompt": P_IMG, "multi_modal_data": {"image_embeds": torch.zeros(1, 4, 64)}}, ValueError,
         r"inputs\[1\]\.multi_modal_data: got image embeddings without 'image_grid_thw'"),
    ]
    for item, exc, match in bad:
        with pytest.raises(exc, match=match):
            llm.generate([ok, item], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="mm_processor_kwargs: unknown key"):
        LLM(str(qwen_ckpt), dtype="float32", mm_processor_kwargs={"nope": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt: unknown modality"):
        LLM(str(qwen_ckpt), dtype="float32", limit_mm_per_prompt={"audio": 1})


def test_mrope_rotary_rows_and_kernel(qwen_ckpt):
    """Each rotary dimension reads its mrope_section row, as transformers' Qwen2VLRotaryEmbedding;
    the bf16 CPU kernel and the torch ops rotate alike; equal rows == 1-D positions."""
    from transformers import AutoConfig

    from mmkit.layers.rotary import RotaryEmbedding

    text = AutoConfig.from_pretrained(str(qwen_ckpt)).text_config
    rotary = RotaryEmbedding(text, 256)
    model, _ = hf_qwen(str(qwen_ckpt))
    positions = torch.randint(0, 200, (3, 37))
    hf_cos, hf_sin = model.model.language_model.rotary_emb(torch.zeros(1), positions[:, None])
    rope = rotary.for_positions(positions, torch.float32)
    cos, signed_sin = rope.rotary.cos_sin(rope.positions, torch.float32)
    half = cos.shape[-1] // 2
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(signed_sin[:, 0, half:], hf_sin[0, :, half:])
    x = torch.randn(37, 6, cos.shape[-1]).bfloat16()
    by_kernel = rotary.for_positions(positions, torch.bfloat16).rotate(x.clone(), 4)
    torch_rope = rotary.for_positions(positions, torch.bfloat16)
    torch_rope.use_kernel = False
    assert torch.equal(by_kernel, torch_rope.rotate(x.clone(), 4))
    same = positions[:1].expand(3, -1)
    assert torch.equal(rotary.for_positions(same, torch.float32).rotate(x.float(), 4),
                       rotary.for_positions(same[0], torch.float32).rotate(x.float(), 4))


def test_hub_layout_and_registry(qwen_ckpt, tmp_path):
    """The hub's key layout (visual.*, model.layers.*, sharded) loads and gives the same ids;
    the architecture is listed among the supported ones."""
    from mmkit.models.registry import supported_architectures

    hub = rewrite_qwen_hub_layout(qwen_ckpt, tmp_path / "hub")
    inputs = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    a = LLM(str(qwen_ckpt), dtype="float32").generate(inputs, greedy(8), use_tqdm=False)
    b = LLM(str(hub), dtype="float32").generate(inputs, greedy(8), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"} <= set(supported_architectures())


def test_prompt_logprobs_match_transformers_at_every_position(qwen_ckpt):
    """Every prompt position (text, two images, their M-RoPE rows) against transformers' own
    forward: the decoder computes the same distribution, not only the same argmax. Also under
    chunked prefill that splits the image runs."""
    model, _ = hf_qwen(str(qwen_ckpt))
    inputs = hf_inputs(qwen_ckpt, P_2IMG, [IMG2, IMG3])
    with torch.no_grad():
        ref = model(**inputs).logits[0].log_softmax(-1)  # [L, vocab]
    ids = inputs["input_ids"][0].tolist()
    expected = torch.tensor([float(ref[p - 1, ids[p]]) for p in range(1, len(ids))])
    for kwargs in ({}, {"max_num_batched_tokens": 5}):
        llm = LLM(str(qwen_ckpt), dtype="float32", enable_prefix_caching=False, **kwargs)
        out = llm.generate({"prompt": P_2IMG, "multi_modal_data": {"image": [IMG2, IMG3]}},
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        got = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (kwargs, (got - expected).abs().max())


def test_llava_refuses_video_and_processor_options(tiny_ckpt):
    """A family without video or processor options says so instead of ignoring them."""
    from conftest import get_llm

    llm = get_llm(tiny_ckpt)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    with pytest.raises(ValueError, match=r"inputs\[0\]\.multi_modal_data: got a 'video'.*takes images only"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": IMG1, "video": FRAMES}}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"inputs\[0\]\.mm_processor_kwargs: .*takes no processor options"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": IMG1},
                      "mm_processor_kwargs": {"max_pixels": 100}}, use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs: .*takes no processor options"):
        LLM(str(tiny_ckpt), dtype="float32", mm_processor_kwargs={"max_pixels": 100})
