"""LFM2-VL, a hybrid decoder (short convolutions + attention), on a tiny random checkpoint built
with transformers' own classes and processor: greedy ids equal transformers' (float32) for a
mixed batch (text, a small image, a tiled image with its thumbnail, two images of different
sizes, token-id prompts), under small chunks that split image spans, a long prompt prefilled in
chunks (the conv windows carried), forced preemption, a repeated request (prefix caching refused),
eight concurrent requests of different lengths, n > 1 samples (each its own request and slot); bad
inputs fail before anything is added."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint

N = 16
SMALL, BIG, WIDE = make_image(2, 20, 24), make_image(1, 120, 80), make_image(3, 90, 33)
P_IMG = "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"
P_2IMG = "<|im_start|>user\n<image> and <image>Describe both.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint("Lfm2VlForConditionalGeneration", tmp_path_factory.mktemp("lfm2vl"), seed=1)


@lru_cache(maxsize=2)
def hf(path: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


_REFS: dict = {}


def hf_greedy(path, prompt=None, images=None, input_ids=None, max_new_tokens=N) -> list[int]:
    key = (str(path), prompt, tuple(map(id, images or ())), tuple(input_ids or ()), max_new_tokens)
    if key not in _REFS:
        model, processor = hf(str(path))
        if input_ids is not None:
            inputs = {"input_ids": torch.tensor([input_ids]), "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
        else:
            inputs = processor(text=[prompt], images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        _REFS[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
    return _REFS[key]


def greedy(max_tokens=N, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def cases(tokenizer):
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    img_ids = tokenizer(P_IMG, add_special_tokens=False).input_ids  # one <image>: mmkit expands it
    return [
        (TEXT, dict(prompt=TEXT)),
        ({"prompt": P_IMG, "multi_modal_data": {"image": SMALL}}, dict(prompt=P_IMG, images=[SMALL])),
        ({"prompt": P_IMG, "multi_modal_data": {"image": BIG}}, dict(prompt=P_IMG, images=[BIG])),
        ({"prompt": P_2IMG, "multi_modal_data": {"image": [WIDE, SMALL]}}, dict(prompt=P_2IMG, images=[WIDE, SMALL])),
        ({"prompt_token_ids": text_ids}, dict(input_ids=text_ids)),
        ({"prompt_token_ids": img_ids, "multi_modal_data": {"image": BIG}}, dict(prompt=P_IMG, images=[BIG])),
    ]


def check_batch(llm, path, selected=None):
    batch = cases(llm.get_tokenizer())
    batch = [batch[i] for i in selected] if selected else batch
    outs = llm.generate([inp for inp, _ in batch], greedy(), use_tqdm=False)
    for out, (_, ref) in zip(outs, batch):
        assert list(out.outputs[0].token_ids) == hf_greedy(path, **ref), ref
    return outs


def assert_slots_returned(llm):
    m = llm.get_metrics()
    assert m["state_slots_free"] == m["state_slots_total"] and m["kv_blocks_free"] == m["kv_blocks_total"]


def test_mixed_batch_equals_transformers(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    spec = llm.llm_engine.config.model.capabilities.state_spec
    assert spec.layer_ids == (0, 1, 3) and spec.recurrent_shape == () and spec.conv_width == 2
    assert llm.get_metrics()["state_bytes_per_request"] == 3 * 64 * 2 * 4  # windows only: no recurrent state
    outs = check_batch(llm, ckpt)
    _, processor = hf(str(ckpt))
    expected = processor(text=[P_IMG], images=[BIG], return_tensors="pt")["input_ids"][0].tolist()
    assert list(outs[2].prompt_token_ids) == expected == list(outs[5].prompt_token_ids)
    assert "<|img_row_2_col_2|>" in llm.get_tokenizer().decode(expected)  # tiles and a thumbnail
    assert_slots_returned(llm)


def test_small_chunks_preemption_and_repeated_request(ckpt):
    # 8-token chunks split the tiled image's 40-token span and the conv windows cross every step.
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=8)
    check_batch(llm, ckpt, [1, 2, 3])
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=12, block_size=8)
    check_batch(llm, ckpt, [0, 2, 3, 5])
    assert llm.get_metrics()["num_preemptions"] >= 1
    assert_slots_returned(llm)
    llm = LLM(str(ckpt), dtype="float32", block_size=4, enable_prefix_caching=True)
    request = {"prompt": P_IMG, "multi_modal_data": {"image": BIG}}
    first, second = (llm.generate(request, greedy(), use_tqdm=False)[0] for _ in range(2))
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == hf_greedy(
        ckpt, prompt=P_IMG, images=[BIG])
    assert llm.get_metrics()["prefix_cache_hits"] == 0


def test_long_prompt_and_eight_concurrent_requests(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=24, max_num_seqs=8)
    tok = llm.get_tokenizer()
    long_ids = tok(" ".join(f"item{i} is red," for i in range(60)), add_special_tokens=False).input_ids
    assert len(long_ids) >= 300
    prompts = [long_ids] + [tok(" ".join(["sea"] * (1 + 6 * i)), add_special_tokens=False).input_ids for i in range(7)]
    lengths = [4 + 3 * i for i in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(max_tokens=n) for n in lengths],
                        use_tqdm=False)
    for p, n, out in zip(prompts, lengths, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, input_ids=p, max_new_tokens=max(lengths))[:n]
    assert_slots_returned(llm)


def test_n_samples_each_have_their_own_state(ckpt):
    """n > 1 is n requests (vLLM v1's fan-out), each with its own convolution-window slot: the
    greedy samples equal the n = 1 output and transformers'."""
    llm = LLM(str(ckpt), dtype="float32", max_num_seqs=2)
    request = {"prompt": P_IMG, "multi_modal_data": {"image": SMALL}}
    ref = hf_greedy(ckpt, prompt=P_IMG, images=[SMALL])
    one = llm.generate(request, greedy(), use_tqdm=False)[0]
    two = llm.generate(request, greedy(n=2), use_tqdm=False)[0]
    assert list(one.outputs[0].token_ids) == ref
    assert [list(c.token_ids) for c in two.outputs] == [ref] * 2 and [c.index for c in two.outputs] == [0, 1]
    assert_slots_returned(llm)


def test_bad_inputs_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    ok = {"prompt": P_IMG, "multi_modal_data": {"image": SMALL}}
    bad = [
        ({"prompt": P_2IMG, "multi_modal_data": {"image": [SMALL]}}, greedy(), r"inputs\[1\]"),
        ({**ok, "mm_processor_kwargs": {"tile": 3}}, greedy(), r"inputs\[1\]\.mm_processor_kwargs: unknown key"),
        ({"prompt": P_IMG, "multi_modal_data": {"image_embeds": torch.zeros(1, 4, 64)}}, greedy(),
         r"inputs\[1\].*without 'image_sizes'"),
    ]
    for prompt, params, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([ok, prompt], [greedy(), params], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        assert_slots_returned(llm)
    out = llm.generate(ok, greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, prompt=P_IMG, images=[SMALL])


def test_chat_renders_the_template_and_gives_transformers_ids(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    from serve_utils import data_uri

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(BIG)}},
                                             {"type": "text", "text": "Describe it."}]}]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    _, processor = hf(str(ckpt))
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                            "text": "Describe it."}]}], add_generation_prompt=True, tokenize=False)
    assert out.prompt == prompt
    assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, prompt=prompt, images=[BIG])
