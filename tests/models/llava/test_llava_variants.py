"""LlavaForConditionalGeneration with every decoder and tower the llava-hf repos use: greedy ids
equal transformers' (float32) for a mixed batch, also with chunked prefill, forced preemption
and the same weights re-saved in the transformers-4.x hub layout."""

import pytest

from conftest import DEVICES, assert_generate_matches_hf, assert_bf16_matches_hf, hf_greedy, make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_llava, rewrite_hub_layout

# id -> build_tiny_llava arguments. Each row changes several axes at once to keep the suite small.
VARIANTS = {
    # bakLlava-like: Mistral decoder (sliding window larger than any test sequence), GQA,
    # two feature layers concatenated (as transformers does), CLS dropped.
    "mistral-clip-layers": dict(text_type="mistral", num_kv_heads=2, sliding_window=256, rope_theta=1e6,
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


def check(llm, path):
    inputs, refs = mixed_batch(llm.get_tokenizer(), llm.llm_engine.config.model.image_token_id)
    return assert_generate_matches_hf(llm, path, inputs, refs, MAX_TOKENS, cache_key=str(path))


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
    # The fp16 checkpoint is upcast by both: compared with transformers on the same files.
    assert_generate_matches_hf(llm, hub, inputs[:3], refs[:3], MAX_TOKENS)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(variant, device):
    """Whole sequences against transformers' own bf16 generate: equal, or first different at a bf16
    tie of transformers' own logits (conftest.assert_bf16_matches_hf)."""
    name, path = variant
    image = make_image(9, 50, 40)
    inputs = ["Write a haiku about the sea.", "the quick brown fox",
              {"prompt": PROMPT1, "multi_modal_data": {"image": image}}]
    refs = [dict(prompt=inputs[0]), dict(prompt=inputs[1]), dict(prompt=PROMPT1, images=image)]
    num_equal = assert_bf16_matches_hf(path, device, inputs, refs)
    print(f"bf16 sequences equal to transformers' {name} {device}: {num_equal} of {len(refs)}")
