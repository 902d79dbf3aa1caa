"""Image embeddings as input for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (processors/qwen_embeds.py):
what transformers' `get_image_features` returns (Qwen3-VL: with its DeepStack feature sets),
with `image_grid_thw`, gives transformers' greedy ids for the same images (float32), alone,
as token-id prompts, beside a raw video, under chunked prefill and with the prefix cache;
wrong shapes fail up front with messages that say the expected layout."""

from __future__ import annotations

import pytest
import torch

from conftest import make_image
from qwen_ref import P_2IMG, P_IMG, P_IMG_VID, hf_inputs, hf_qwen, hf_qwen_greedy
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint

N = 32
IMG1, IMG2, IMG3 = make_image(1, 60, 40), make_image(2, 30, 50), make_image(3, 90, 33)
FRAMES = [make_image(10 + i, 48, 32) for i in range(6)]
ARCHS = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
         "Qwen3VLMoeForConditionalGeneration"]


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    # Seed 1's Qwen2.5-VL has <|im_end|> as its argmax at step 8 of one prompt: transformers'
    # min_new_tokens masks it, mmkit's ignore_eos does not (a harness difference, not a model one).
    seed = 3 if request.param.startswith("Qwen2_5") else 1
    return build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param[:9]), seed=seed)


def greedy(max_tokens=N):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def given(path, images) -> dict:
    """transformers' own image features of `images` in the documented layout."""
    model, _ = hf_qwen(str(path))
    ref = hf_inputs(path, P_IMG, images[:1]) if len(images) == 1 else hf_inputs(path, P_2IMG, images)
    with torch.no_grad():
        out = model.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    parts = [_joined(out.pooler_output)]
    parts += [_joined(f) for f in (getattr(out, "deepstack_features", None) or [])]
    return {"image_embeds": torch.cat(parts, dim=-1), "image_grid_thw": ref["image_grid_thw"]}


def _joined(features) -> torch.Tensor:
    """Per-image feature rows joined (transformers 5.17 returns them joined already)."""
    return features if isinstance(features, torch.Tensor) else torch.cat(features)


def test_given_embeddings_give_transformers_ids(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    two, one = given(ckpt, [IMG2, IMG3]), given(ckpt, [IMG1])
    ids = llm.get_tokenizer()(P_IMG).input_ids
    batch = [
        ({"prompt": P_2IMG, "multi_modal_data": {"image": two}}, (P_2IMG, [IMG2, IMG3], None)),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image_embeds": one}}, (P_IMG, [IMG1], None)),
        ({"prompt": P_IMG_VID, "multi_modal_data": {"image": given(ckpt, [IMG3]), "video": FRAMES}},
         (P_IMG_VID, [IMG3], FRAMES)),
        ({"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, (P_IMG, [IMG1], None)),
    ]
    outs = llm.generate([inp for inp, _ in batch], greedy(), use_tqdm=False)
    for out, (_, (prompt, images, videos)) in zip(outs, batch):
        assert list(out.outputs[0].token_ids) == hf_qwen_greedy(ckpt, prompt, images, videos, N), prompt
    # The vision tower ran for the video and the raw image only.
    assert llm.llm_engine.model_runner.num_vision_calls == 2
    # A [N, tokens, width] tensor of equal counts is the same input.
    same = {"image_embeds": one["image_embeds"].unsqueeze(0), "image_grid_thw": one["image_grid_thw"][0]}
    again = llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": same}}, greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_chunked_prefill_and_prefix_cache_keys(ckpt):
    one = given(ckpt, [IMG1])
    want = hf_qwen_greedy(ckpt, P_IMG, [IMG1], None, N)
    chunked = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=8)  # splits the 16-token run
    assert chunked.generate({"prompt": P_IMG, "multi_modal_data": {"image": one}}, greedy(),
                            use_tqdm=False)[0].outputs[0].token_ids == want
    llm = LLM(str(ckpt), dtype="float32", block_size=4)
    llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": one}}, greedy(), use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hits"]
    second = llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": one}}, greedy(), use_tqdm=False)[0]
    assert llm.get_metrics()["prefix_cache_hits"] > hits and second.outputs[0].token_ids == want
    # The same rows on a transposed grid get other M-RoPE positions: no block may be shared.
    t, h, w = one["image_grid_thw"][0].tolist()
    moved = {**one, "image_grid_thw": torch.tensor([[t, w, h]])}
    got = llm.generate({"prompt": P_IMG, "multi_modal_data": {"image": moved}}, greedy(), use_tqdm=False)[0]
    fresh = LLM(str(ckpt), dtype="float32").generate({"prompt": P_IMG, "multi_modal_data": {"image": moved}},
                                                     greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_bad_embeddings_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32", limit_mm_per_prompt={"image": 1})
    one = given(ckpt, [IMG1])
    emb, grid = one["image_embeds"], one["image_grid_thw"]
    hidden = llm.llm_engine.model_runner.model.config.text_config.hidden_size
    deepstack = emb.shape[1] // hidden - 1
    ok = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"image_embeds": emb[:-1], "image_grid_thw": grid}, ValueError,
         rf"inputs\[1\]\.multi_modal_data\['image_embeds'\]: got shape \({emb.shape[0] - 1}, {emb.shape[1]}\); "
         rf"expected \[{emb.shape[0]}, {emb.shape[1]}\]"),
        ({"image_embeds": emb}, ValueError, r"without 'image_grid_thw'"),
        ({"image_embeds": emb, "image_grid_thw": grid.float()}, TypeError, r"expected an integer tensor"),
        ({"image_embeds": emb, "image_grid_thw": grid[:, :2]}, ValueError, r"got shape \(1, 2\); expected \[N, 3\]"),
        ({"image_embeds": emb, "image_grid_thw": grid + 1}, ValueError, r"multiples of spatial_merge_size = 2"),
        ({"image_embeds": emb, "image_grid_thw": grid, "grid": grid}, ValueError, r"field\(s\) \['grid'\]"),
        ({"image_embeds": emb, "image_grid_thw": "1x4x4"}, TypeError, r"\['image_grid_thw'\]: got str"),
        ({"image_embeds": torch.cat([emb, emb]), "image_grid_thw": torch.cat([grid, grid])}, ValueError,
         r"got 2 images; expected at most limit_mm_per_prompt\['image'\] = 1"),
    ]
    if deepstack:  # Qwen3-VL: the merged features alone miss the DeepStack columns
        bad.append(({"image_embeds": emb[:, :hidden], "image_grid_thw": grid}, ValueError,
                    rf"x \(1 \+ {deepstack} DeepStack layers\): get_image_features' pooler_output and deepstack_features"))
    for data, exc, match in bad:
        with pytest.raises(exc, match=match):
            llm.generate([ok, {"prompt": P_IMG, "multi_modal_data": {"image": data}}], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_llava_refuses_embedding_fields(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    data = {"image_embeds": torch.zeros(1, 4, 64), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=r"inputs\[0\]\.multi_modal_data: got image embeddings with "
                                         r"\['image_grid_thw'\]; LlavaForConditionalGeneration takes a tensor"):
        llm.generate({"prompt": "USER: <image>\nHi ASSISTANT:", "multi_modal_data": {"image_embeds": data}},
                     use_tqdm=False)
