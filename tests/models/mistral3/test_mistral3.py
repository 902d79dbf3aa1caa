"""Mistral 3 (Pixtral tower, [IMG_BREAK]/[IMG_END] rows, patch merger, Mistral decoder)
against transformers: processor ids for many sizes, float32 greedy ids for a mixed batch (also
chunked, preempted, prefix-cached, in the 4.x hub layout), and bad inputs refused up front."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, assert_bf16_matches_hf, make_image, pil_to_tensor
from span_ref import check_prefix_cache_hit, hf_span_greedy, hf_span_inputs
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.mistral3 import rewrite_mistral3_hub_layout

N = 33
P1 = "[INST][IMG]What is in the image?[/INST]"
P2 = "[INST][IMG] and [IMG]Compare the two.[/INST]"
TEXT = "[INST]Write a haiku about the sea.[/INST]"
# (width, height): under the 96 px longest edge, over it (resized), thin, one patch.
SIZES = [(40, 30), (90, 50), (20, 70), (200, 120), (100, 9), (5, 5)]
IMG1, IMG2, IMG3 = make_image(1, 40, 30), make_image(2, 90, 50), make_image(3, 200, 120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("Mistral3ForConditionalGeneration", tmp_path_factory.mktemp("mistral3"), seed=2)


def greedy(max_tokens=N):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _parsed(prompt, images):
    from mmkit.multimodal.parse import parse_prompt

    return parse_prompt(0, {"prompt": prompt, "multi_modal_data": {"image": images}})


def test_processor_ids_and_rows_equal_transformers(ckpt):
    """Every size: mmkit's ids are the PixtralProcessor's; each span's rows are the model's."""
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=8)
    proc, model = llm.llm_engine.input_processor, llm.llm_engine.model_runner.model
    for prompt, images in [(P1, [make_image(i, w, h)]) for i, (w, h) in enumerate(SIZES)] + [(P2, [IMG2, IMG3])]:
        processed = proc.process(_parsed(prompt, images))
        assert processed.prompt_token_ids == hf_span_inputs(ckpt, prompt, images)["input_ids"][0].tolist()
        with torch.no_grad():
            rows = model.embed_multimodal([proc.mm_item_inputs(item) for item in processed.images])
        assert [r.shape[0] for r in rows] == [n for _, n in processed.placeholder_ranges]


def _batch(tokenizer):
    cases = [(TEXT, None), (P1, [IMG1]), (P2, [IMG2, IMG3]), (P1, [IMG3])]
    inputs = [TEXT] + [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases[1:]]
    inputs.append({"prompt_token_ids": tokenizer(P1).input_ids, "multi_modal_data": {"image": pil_to_tensor(IMG1)}})
    return inputs, cases + [(P1, [IMG1])]


def test_mixed_batch_chunked_preempted_equal_transformers(ckpt):
    """Text, one image, two images of different sizes, a token-id prompt (one [IMG], expanded by
    mmkit) and the same prompt already expanded; then chunked prefill and forced preemption."""
    llm = LLM(str(ckpt), dtype="float32")
    inputs, cases = _batch(llm.get_tokenizer())
    refs = [hf_span_greedy(ckpt, p, ims) for p, ims in cases]
    outs = llm.generate(inputs, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    expanded = {"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"image": IMG1}}
    assert llm.generate(expanded, greedy(), use_tqdm=False)[0].outputs[0].token_ids == refs[1]
    for kwargs in (dict(max_num_batched_tokens=7), dict(num_kv_blocks=16, block_size=8)):
        small = LLM(str(ckpt), dtype="float32", **kwargs)
        assert [o.outputs[0].token_ids for o in small.generate(inputs, greedy(), use_tqdm=False)] == refs, kwargs
        if "num_kv_blocks" in kwargs:
            assert small.get_metrics()["num_preemptions"] > 0


def test_prefix_cache_hit_reuses_the_image(ckpt):
    check_prefix_cache_hit(ckpt, P1, IMG2, greedy())


def test_hub_layout_gives_the_same_ids(ckpt, tmp_path):
    hub = rewrite_mistral3_hub_layout(ckpt, tmp_path / "hub")
    assert any(k.startswith("vision_tower.transformer.") for k in _keys(hub))
    llm = LLM(str(hub), dtype="float32")
    out = llm.generate({"prompt": P2, "multi_modal_data": {"image": [IMG2, IMG3]}}, greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_span_greedy(hub, P2, [IMG2, IMG3])


def _keys(path):
    import json

    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_bad_inputs_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32", limit_mm_per_prompt={"image": 2})
    ok = {"prompt": P1, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"prompt": "[INST][IMG][IMG][IMG]x[/INST]", "multi_modal_data": {"image": [IMG1, IMG2, IMG3]}},
         r"inputs\[1\]\.multi_modal_data: got 3 images; expected at most limit_mm_per_prompt\['image'\] = 2"),
        ({"prompt": P1, "multi_modal_data": {"image": [IMG1, IMG2]}},
         r"inputs\[1\]: the prompt has 1 image placeholder\(s\) for 2 image\(s\)"),
        ({"prompt": P1}, r"inputs\[1\]: the prompt has 1 image placeholder\(s\) for 0 image\(s\)"),
        ({**ok, "mm_processor_kwargs": {"size": {"longest_edge": 32}}},
         r"inputs\[1\]\.mm_processor_kwargs: .*takes no processor options"),
        ({"prompt": P1, "multi_modal_data": {"video": [IMG1, IMG1]}}, r"inputs\[1\]\.multi_modal_data: got a 'video'"),
        ({"prompt": P1, "multi_modal_data": {"image_embeds": torch.zeros(1, 8, 64)}},
         r"inputs\[1\]\.multi_modal_data\.image\[0\]: got image embeddings without 'image_sizes'"),
    ]
    for item, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([ok, item], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="mm_processor_kwargs: .*takes no processor options"):
        LLM(str(ckpt), dtype="float32", mm_processor_kwargs={"size": {"longest_edge": 32}})


def test_sliding_window_decoder_equals_transformers(tmp_path):
    """A decoder with a 16-token window and prompts far longer than it: the image inside the
    window (near the end) and outside it (at the start), greedy ids equal transformers'; also
    with chunked prefill."""
    path = build_tiny_checkpoint("Mistral3ForConditionalGeneration", tmp_path / "sliding", seed=5, sliding_window=16)
    filler = " the quick brown fox jumps over the lazy dog" * 3
    early = f"[INST][IMG]{filler} What was in the image?[/INST]"  # image beyond the window
    late = f"[INST]{filler} Now look: [IMG]What is it?[/INST]"  # image inside the window
    cases = [(early, [IMG2]), (late, [IMG1]), (f"[INST][IMG]{filler}[IMG]Compare.[/INST]", [IMG3, IMG1])]
    refs = [hf_span_greedy(path, p, ims) for p, ims in cases]
    inputs = [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases]
    for kwargs in ({}, {"max_num_batched_tokens": 8}):
        llm = LLM(str(path), dtype="float32", **kwargs)
        outs = llm.generate(inputs, greedy(), use_tqdm=False)
        assert llm.llm_engine.config.model.capabilities.sliding_window == 16
        assert all(len(o.prompt_token_ids) > 48 for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == refs, kwargs


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(ckpt, device):
    """Whole sequences against transformers' own bf16 generate: equal, or first different at a bf16
    tie of transformers' own logits (conftest.assert_bf16_matches_hf)."""
    inputs = [TEXT, {"prompt": P1, "multi_modal_data": {"image": IMG3}},
              {"prompt": P2, "multi_modal_data": {"image": [IMG1, IMG2]}}]
    refs = [dict(prompt=TEXT), dict(prompt=P1, images=[IMG3]), dict(prompt=P2, images=[IMG1, IMG2])]
    num_equal = assert_bf16_matches_hf(ckpt, device, inputs, refs)
    print(f"bf16 sequences equal to transformers' mistral3 {device}: {num_equal} of {len(refs)}")
