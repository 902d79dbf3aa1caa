"""Idefics3 and SmolVLM (tiles + global view, pixel-shuffle connector, Llama decoder; SmolVLM
video) against transformers: processor ids, float32 greedy ids for a mixed batch (also chunked,
preempted, prefix-cached, in the 4.x hub layout), per-request splitting / size, bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import DEVICES, assert_bf16_matches_hf, make_image, pil_to_tensor
from span_ref import check_prefix_cache_hit, hf_span_greedy, hf_span_inputs
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.idefics3 import rewrite_idefics3_hub_layout

N = 33
ARCHS = {"smolvlm": "SmolVLMForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration"}
P1 = "User:<image>What is in the image?<end_of_utterance>\nAssistant:"
P2 = "User:<image>and<image>Compare the two.<end_of_utterance>\nAssistant:"
PV = "User: <video>Describe this video.<end_of_utterance>\nAssistant:"
TEXT = "User: Write a haiku about the sea.<end_of_utterance>\nAssistant:"
# (width, height): one tile (no split), 2x1, 1x2, 2x2 after the 64 px resize, tiny.
SIZES = [(30, 20), (60, 30), (20, 50), (200, 190), (3, 7)]
IMG1, IMG2, IMG3 = make_image(1, 40, 30), make_image(2, 90, 50), make_image(3, 20, 70)
FRAMES = [make_image(10 + i, 48, 32) for i in range(3)]


def videos_of(frames):
    """One video as the prompt's list of videos (the reference gets `videos=[[frames]]`): transformers
    5.17's SmolVLMProcessor reads `[frames]` as several one-frame videos, later ones either form."""
    return None if frames is None else [frames]


@pytest.fixture(scope="module", params=list(ARCHS))
def ckpt(request, tmp_path_factory):
    path = build_tiny_checkpoint(ARCHS[request.param], tmp_path_factory.mktemp(request.param), seed=4)
    return request.param, path


def greedy(max_tokens=N):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_processor_ids_and_rows_equal_transformers(ckpt):
    from mmkit.multimodal.parse import parse_prompt

    family, path = ckpt
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    proc, model = llm.llm_engine.input_processor, llm.llm_engine.model_runner.model
    cases = [(P1, [make_image(i, w, h)], None) for i, (w, h) in enumerate(SIZES)] + [(P2, [IMG2, IMG3], None)]
    if family == "smolvlm":
        cases.append((PV, None, FRAMES))
    for prompt, images, video in cases:
        mm = {"image": images} if images else {"video": video}
        processed = proc.process(parse_prompt(0, {"prompt": prompt, "multi_modal_data": mm}))
        ref = hf_span_inputs(path, prompt, images, videos_of(video))["input_ids"][0].tolist()
        assert processed.prompt_token_ids == ref, (prompt, [im.size for im in images or []])
        with torch.no_grad():
            rows = model.embed_multimodal([proc.mm_item_inputs(item) for item in processed.images])
        assert [r.shape[0] for r in rows] == [n for _, n in processed.placeholder_ranges]


def _batch(family, tokenizer):
    cases = [(TEXT, None, None), (P1, [IMG1], None), (P2, [IMG2, IMG3], None), (P1, [IMG3], None)]
    if family == "smolvlm":
        cases.append((PV, None, FRAMES))
    inputs = [TEXT] + [{"prompt": p, "multi_modal_data": {"image": ims} if ims else {"video": vid}}
                       for p, ims, vid in cases[1:]]
    inputs.append({"prompt_token_ids": tokenizer(P2).input_ids,
                   "multi_modal_data": {"image": [pil_to_tensor(IMG2), IMG3]}})
    return inputs, cases + [(P2, [IMG2, IMG3], None)]


def test_mixed_batch_chunked_preempted_equal_transformers(ckpt):
    """Text, one image, two images of different sizes (other tile grids), a SmolVLM video, a
    token-id prompt (placeholders expanded by mmkit); then chunked prefill and preemption."""
    family, path = ckpt
    llm = LLM(str(path), dtype="float32")
    inputs, cases = _batch(family, llm.get_tokenizer())
    refs = [hf_span_greedy(path, p, ims, videos_of(vid)) for p, ims, vid in cases]
    outs = llm.generate(inputs, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    expanded = {"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"image": IMG1}}
    assert llm.generate(expanded, greedy(), use_tqdm=False)[0].outputs[0].token_ids == refs[1]
    for kwargs in (dict(max_num_batched_tokens=9), dict(num_kv_blocks=30, block_size=8)):
        small = LLM(str(path), dtype="float32", **kwargs)
        assert [o.outputs[0].token_ids for o in small.generate(inputs, greedy(), use_tqdm=False)] == refs, kwargs
        if "num_kv_blocks" in kwargs:
            assert small.get_metrics()["num_preemptions"] > 0


def test_prefix_cache_hit_and_hub_layout(ckpt, tmp_path):
    family, path = ckpt
    check_prefix_cache_hit(path, P1, IMG2, greedy())
    hub = rewrite_idefics3_hub_layout(path, tmp_path / "hub")
    out = LLM(str(hub), dtype="float32").generate({"prompt": P2, "multi_modal_data": {"image": [IMG2, IMG3]}},
                                                  greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_span_greedy(hub, P2, [IMG2, IMG3])


def test_mm_processor_kwargs_change_one_requests_layout(ckpt):
    """do_image_splitting / size per request (and engine-wide): other spans, no cache sharing,
    transformers' ids with the same options."""
    family, path = ckpt
    if family != "smolvlm":
        pytest.skip("the same processor code; run once")
    llm = LLM(str(path), dtype="float32")
    base = {"prompt": P1, "multi_modal_data": {"image": IMG2}}
    options = [None, {"do_image_splitting": False}, {"size": {"longest_edge": 32}}]
    outs = llm.generate([{**base, "mm_processor_kwargs": o} for o in options], greedy(), use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert lengths[0] > lengths[1] and lengths[0] > lengths[2]
    assert llm.get_metrics()["encoder_cache_misses"] == 3
    for o, opt in zip(outs, options):
        assert o.prompt_token_ids == hf_span_inputs(path, P1, [IMG2], mm_kwargs=opt)["input_ids"][0].tolist()
        assert o.outputs[0].token_ids == hf_span_greedy(path, P1, [IMG2], mm_kwargs=opt)
    engine_wide = LLM(str(path), dtype="float32", mm_processor_kwargs={"do_image_splitting": False})
    again = engine_wide.generate([base, {**base, "mm_processor_kwargs": {"do_image_splitting": True}}], greedy(),
                                 use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert again[1].prompt_token_ids == outs[0].prompt_token_ids


def test_bad_inputs_fail_before_anything_is_added(ckpt, monkeypatch):
    family, path = ckpt
    llm = LLM(str(path), dtype="float32", limit_mm_per_prompt={"image": 2, "video": 1})
    ok = {"prompt": P1, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"prompt": "User:<image><image><image>x", "multi_modal_data": {"image": [IMG1, IMG2, IMG3]}},
         r"inputs\[1\]\.multi_modal_data: got 3 images; expected at most limit_mm_per_prompt\['image'\] = 2"),
        ({"prompt": P1, "multi_modal_data": {"image": [IMG1, IMG2]}},
         r"inputs\[1\]: the prompt has 1 <image> placeholder\(s\) for 2 image\(s\)"),
        ({**ok, "mm_processor_kwargs": {"do_splitting": False}},
         r"inputs\[1\]\.mm_processor_kwargs: unknown key\(s\) \['do_splitting'\]; expected only "
         r"\['do_image_splitting', 'size'\]"),
        ({**ok, "mm_processor_kwargs": {"size": {"longest_edge": -3}}}, r"\['size'\]: got .*positive int"),
        ({**ok, "mm_processor_kwargs": {"do_image_splitting": "no"}}, "expected True or False"),
    ]
    if family == "idefics3":
        bad.append(({"prompt": PV, "multi_modal_data": {"video": FRAMES}},
                    r"inputs\[1\]\.multi_modal_data: got a 'video'; Idefics3ForConditionalGeneration takes images "
                    r"only"))
    else:
        bad.append(({"prompt": PV + PV, "multi_modal_data": {"video": [FRAMES, FRAMES]}},
                    r"inputs\[1\]\.multi_modal_data: got 2 videos; expected at most"))
    for item, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([ok, item], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    if family == "smolvlm":  # a processor that would sample the given frames needs their frame rate
        monkeypatch.setattr(llm.llm_engine.input_processor.video_processor, "do_sample_frames", True)
        with pytest.raises(ValueError, match=r"inputs\[1\]\.multi_modal_data\['video'\]: .*do_sample_frames=True"):
            llm.generate([ok, {"prompt": PV, "multi_modal_data": {"video": FRAMES}}], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="mm_processor_kwargs: unknown key"):
        LLM(str(path), dtype="float32", mm_processor_kwargs={"nope": 1})


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(ckpt, device):
    """Whole sequences against transformers' own bf16 generate: equal, or first different at a bf16
    tie of transformers' own logits (conftest.assert_bf16_matches_hf)."""
    family, path = ckpt
    inputs = [TEXT, {"prompt": P1, "multi_modal_data": {"image": IMG3}},
              {"prompt": P2, "multi_modal_data": {"image": [IMG1, IMG2]}}]
    refs = [dict(prompt=TEXT), dict(prompt=P1, images=[IMG3]), dict(prompt=P2, images=[IMG1, IMG2])]
    num_equal = assert_bf16_matches_hf(path, device, inputs, refs)
    print(f"bf16 sequences equal to transformers' {family} {device}: {num_equal} of {len(refs)}")


def test_generic_code_names_no_span_family():
    """The span families plug in through models/ and processors/ alone: the engine, the worker,
    the config and the LLM never name them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "mmkit"
    files = [*(root / "engine").rglob("*.py"), *(root / "worker").rglob("*.py"), root / "config.py", root / "entrypoints" / "llm.py"]
    pattern = re.compile(r"mistral3|pixtral|idefics|smolvlm|\[IMG_BREAK\]", re.IGNORECASE)
    named = [f"{f.relative_to(root)}:{i + 1}" for f in files
             for i, line in enumerate(f.read_text().splitlines()) if pattern.search(line)]
    assert len(files) > 10 and named == []


def test_chat_image_and_video_parts(ckpt):
    """LLM.chat renders the checkpoint's template (an image part and, for SmolVLM, a video part)
    and the result is transformers' for the rendered prompt."""
    family, path = ckpt
    llm = LLM(str(path), dtype="float32")
    cases = [({"type": "image", "image": IMG2}, {"images": [IMG2]}, "<image>")]
    if family == "smolvlm":
        cases.append(({"type": "video_url", "video_url": {"url": FRAMES}}, {"videos": videos_of(FRAMES)},
                      "<video>"))
    for part, kwargs, placeholder in cases:
        msg = [{"role": "user", "content": [part, {"type": "text", "text": "What is shown?"}]}]
        out = llm.chat(msg, greedy(), use_tqdm=False)[0]
        assert out.prompt.count(placeholder) == 1
        assert out.prompt_token_ids == hf_span_inputs(path, out.prompt, **kwargs)["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == hf_span_greedy(path, out.prompt, **kwargs)
