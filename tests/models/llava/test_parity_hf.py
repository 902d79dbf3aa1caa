"""Greedy token ids identical to transformers' LlavaForConditionalGeneration.generate (float32)."""

import pytest
import torch

from conftest import DEVICES, get_llm, hf_greedy, make_image, pil_to_tensor
from mmkit import MultiModalData, SamplingParams

IMG = MultiModalData.Type.IMAGE
PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"


def greedy(max_tokens=16):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def run(llm, inputs, max_tokens=16):
    return llm.generate(inputs, greedy(max_tokens), use_tqdm=False)


@pytest.mark.parametrize("device", DEVICES)
def test_text_only(tiny_ckpt, device):
    llm = get_llm(tiny_ckpt, device)
    out = run(llm, "Write a haiku about the sea.", 24)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt="Write a haiku about the sea.",
                                                    max_new_tokens=24)


@pytest.mark.parametrize("device", DEVICES)
def test_one_pil_image_and_tensor_forms(tiny_ckpt, device):
    llm = get_llm(tiny_ckpt, device)
    img = make_image(1)
    ref = hf_greedy(tiny_ckpt, prompt=PROMPT, images=img, max_new_tokens=16)
    as_pil = run(llm, {"prompt": PROMPT, "multi_modal_data": MultiModalData(type=IMG, data=img)})
    u8 = pil_to_tensor(img)
    as_u8 = run(llm, {"prompt": PROMPT, "multi_modal_data": MultiModalData(type=IMG, data=u8[None])})
    as_chw = run(llm, {"prompt": PROMPT, "multi_modal_data": {"image": u8}})
    as_float = run(llm, {"prompt": PROMPT,
                         "multi_modal_data": MultiModalData(type=IMG, data=u8[None].float() / 255)})
    as_f16 = run(llm, {"prompt": PROMPT, "multi_modal_data": {"image": (u8.double() / 255).half()}})
    for out in (as_pil, as_u8, as_chw, as_float, as_f16):
        assert out[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("device", DEVICES)
def test_batch_each_equals_its_own_hf_run(tiny_ckpt, device):
    llm = get_llm(tiny_ckpt, device)
    questions = ["What is in the image?", "Describe it.", "How many shapes are there in this picture?",
                 "Is there a triangle?", "What color is the square on the left of the image?", "Caption."]
    max_tokens = [5, 40, 12, 1, 33, 20]
    prompts = [f"USER: <image>\n{q} ASSISTANT:" for q in questions]
    images = [make_image(10 + i, 20 + 9 * i, 50 - 4 * i) for i in range(len(prompts))]
    inputs = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)]
    outs = llm.generate(inputs, [greedy(m) for m in max_tokens], use_tqdm=False)
    for out, p, im, m in zip(outs, prompts, images, max_tokens):
        ref = hf_greedy(tiny_ckpt, prompt=p, images=im, max_new_tokens=m)
        assert out.outputs[0].token_ids == ref
        assert out.prompt == p


@pytest.mark.parametrize("device", DEVICES)
def test_two_images_in_one_prompt(tiny_ckpt, device):
    llm = get_llm(tiny_ckpt, device)
    prompt = "USER: <image>\nand <image>\nCompare the two. ASSISTANT:"
    images = [make_image(3), make_image(4, 64, 64)]
    out = run(llm, {"prompt": prompt, "multi_modal_data": MultiModalData(type=IMG, data=images)}, 20)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt=prompt, images=images, max_new_tokens=20)


@pytest.mark.parametrize("device", DEVICES)
def test_token_id_prompts(tiny_ckpt, device):
    llm = get_llm(tiny_ckpt, device)
    tok = llm.get_tokenizer()
    ids = tok("Write a haiku about the sea.").input_ids
    out = run(llm, {"prompt_token_ids": ids}, 20)
    assert out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, input_ids=ids, max_new_tokens=20)
    # With an image: the image token once, or already expanded; both give HF's output.
    img = make_image(5)
    once = tok(PROMPT).input_ids
    image_id = llm.llm_engine.config.model.image_token_id
    n = llm.llm_engine.config.model.capabilities.image_seq_length
    expanded = []
    for t in once:
        expanded.extend([t] * n if t == image_id else [t])
    ref = hf_greedy(tiny_ckpt, input_ids=expanded, images=img, max_new_tokens=12)
    a = run(llm, {"prompt_token_ids": once, "multi_modal_data": {"image": img}}, 12)
    b = run(llm, {"prompt_token_ids": expanded, "multi_modal_data": {"image": img}}, 12)
    assert a[0].outputs[0].token_ids == ref == b[0].outputs[0].token_ids
    assert a[0].prompt_token_ids == expanded


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_tied_checkpoint(gqa_tied_ckpt, device):
    llm = get_llm(gqa_tied_ckpt, device)
    img = make_image(6)
    out = run(llm, {"prompt": PROMPT, "multi_modal_data": {"image": img}}, 40)
    assert out[0].outputs[0].token_ids == hf_greedy(gqa_tied_ckpt, prompt=PROMPT, images=img, max_new_tokens=40)
    assert len(out[0].outputs[0].token_ids) >= 32 or out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("device", DEVICES)
def test_hub_layout_checkpoint(hub_ckpt, device):
    assert (hub_ckpt / "model.safetensors.index.json").exists()
    llm = get_llm(hub_ckpt, device)
    img = make_image(7)
    out = run(llm, {"prompt": PROMPT, "multi_modal_data": {"image": img}}, 32)
    assert out[0].outputs[0].token_ids == hf_greedy(hub_ckpt, prompt=PROMPT, images=img, max_new_tokens=32)


def test_long_generation_32_plus_tokens(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    out = llm.generate("The quick brown fox", greedy(64), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 32
    assert out.token_ids == hf_greedy(tiny_ckpt, prompt="The quick brown fox", max_new_tokens=64)


def test_text_equals_tokenizer_decode(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    out = llm.generate("café naïve 日本語", greedy(30), use_tqdm=False)[0].outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
