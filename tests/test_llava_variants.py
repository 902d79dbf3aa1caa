"""LlavaForConditionalGeneration with every decoder and tower the llava-hf repos use: greedy ids
equal transformers' (float32) for a mixed batch, also with chunked prefill, forced preemption
and the same weights re-saved in the transformers-4.x hub layout."""

import pytest
import torch

from conftest import DEVICES, hf_greedy, make_image, prefix_agreement
from mmkit import LLM, SamplingParams
from tiny_llava import build_tiny_llava, rewrite_hub_layout

# id -> build_tiny_llava arguments. Each row changes several axes at once to keep the suite small.
VARIANTS = {
    # bakLlava-like: Mistral decoder (sliding window larger than any test sequence), GQA,
    # two feature layers concatenated (as transformers does), CLS dropped.
    "mistral-clip-layers": dict(text_type="mistral", num_kv_heads=2, sliding_window=256,
                                vision_feature_layer=[-2, -1], select_strategy="default"),
    # llava-interleave-qwen-like: Qwen2 decoder (q/k/v bias), SigLIP tower, every feature row, tied.
    "qwen2-siglip-full": dict(text_type="qwen2", num_kv_heads=2, vision_type="siglip",
                              vision_feature_layer=-1, select_strategy="full", tie_word_embeddings=True),
    # Llama with SigLIP under "default" (drops SigLIP's first patch row) and CLIP-style layer -2.
    "llama-siglip-default": dict(vision_type="siglip", vision_feature_layer=-2, select_strategy="default"),
    # Llama with CLIP under "full" (keeps the CLS row).
    "llama-clip-full": dict(vision_feature_layer=-1, select_strategy="full", seed=3),
}
MAX_TOKENS = 34
PROMPT1 = "USER: <image>\nWhat is in the image? ASSISTANT:"
PROMPT2 = "USER: <image>\nand <image>\nCompare the two. ASSISTANT:"


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = build_tiny_llava(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return request.param, path


def mixed_batch(tokenizer, image_token_id):
    """(inputs, HF reference kwargs) for: text, one image, two images of different sizes and
    aspect ratios, token ids without and with an image."""
    one = make_image(1, 40, 30)
    two = [make_image(2, 64, 24), make_image(3, 20, 50)]
    text_ids = tokenizer("Write a haiku about the sea.").input_ids
    image_ids = tokenizer(PROMPT1).input_ids
    assert image_token_id in image_ids
    inputs = [
        "Write a haiku about the sea.",
        {"prompt": PROMPT1, "multi_modal_data": {"image": one}},
        {"prompt": PROMPT2, "multi_modal_data": {"image": two}},
        {"prompt_token_ids": text_ids},
        {"prompt_token_ids": image_ids, "multi_modal_data": {"image": one}},
    ]
    refs = [dict(prompt="Write a haiku about the sea."), dict(prompt=PROMPT1, images=one),
            dict(prompt=PROMPT2, images=two), dict(input_ids=text_ids), dict(prompt=PROMPT1, images=one)]
    return inputs, refs


_REFS: dict = {}


def reference(path, refs):
    key = str(path)
    if key not in _REFS:
        _REFS[key] = [hf_greedy(path, max_new_tokens=MAX_TOKENS, ignore_eos=True, **r) for r in refs]
    return _REFS[key]


def check(llm, path):
    cfg = llm.llm_engine.config.model
    inputs, refs = mixed_batch(llm.get_tokenizer(), cfg.image_token_id)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(inputs, params, use_tqdm=False)
    expected = reference(path, refs)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"inputs[{i}]"
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_equals_transformers(variant, device):
    name, path = variant
    check(LLM(str(path), dtype="float32", device=device), path)


def test_chunked_prefill_and_forced_preemption(variant):
    _, path = variant
    check(LLM(str(path), dtype="float32", max_num_batched_tokens=8), path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=10, block_size=16)
    check(llm, path)
    assert llm.get_metrics()["num_preemptions"] >= 1


def test_hub_layout_resave_gives_the_same_ids(variant, tmp_path):
    _, path = variant
    hub = rewrite_hub_layout(path, tmp_path / "hub")
    assert len(list(hub.glob("*.safetensors"))) == 2
    llm = LLM(str(hub), dtype="float32")
    inputs, refs = mixed_batch(llm.get_tokenizer(), llm.llm_engine.config.model.image_token_id)
    outs = llm.generate(inputs[:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    # The fp16 checkpoint is upcast by both: compare with transformers on the same files.
    for out, r in zip(outs, refs):
        assert out.outputs[0].token_ids == hf_greedy(hub, max_new_tokens=MAX_TOKENS, ignore_eos=True, **r)


def test_mistral_sliding_window_limits_sequences_to_the_window(tmp_path):
    path = build_tiny_llava(tmp_path / "swa", text_type="mistral", sliding_window=40, seed=5)
    with pytest.raises(ValueError, match=r"max_model_len: got 100; .*sliding-window attention \(window 40"):
        LLM(str(path), dtype="float32", max_model_len=100)
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == 40
    long_prompt = "the quick brown fox " * 12
    with pytest.raises(ValueError, match=r"inputs\[1\].*expected at most max_model_len = 40 .*sliding attention window"):
        llm.generate(["Hello", long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    # Inside the window both attentions agree; the sequence stops at the window.
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0]
    num_prompt = len(out.prompt_token_ids)
    assert len(out.outputs[0].token_ids) == 40 - num_prompt and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy(path, prompt="Hello", max_new_tokens=40 - num_prompt,
                                                 ignore_eos=True)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(variant, device):
    """bf16 is rounding-sensitive (near-ties can flip): whole sequences are compared and the
    agreement rate (tokens before the first divergence) is reported and must be >= 90%."""
    name, path = variant
    llm = LLM(str(path), dtype="bfloat16", device=device)
    image = make_image(9, 50, 40)
    cases = [dict(prompt="Write a haiku about the sea."), dict(prompt="the quick brown fox"),
             dict(prompt=PROMPT1, images=image)]
    inputs = [c["prompt"] if "images" not in c else {"prompt": c["prompt"], "multi_modal_data": {"image": image}}
              for c in cases]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    ref = [hf_greedy(path, max_new_tokens=16, dtype=torch.bfloat16, ignore_eos=True, **c) for c in cases]
    rate = prefix_agreement(got, ref)
    print(f"bf16 agreement {name} {device}: {rate:.1%}")
    assert rate >= 0.9, (rate, got, ref)
