"""LLaVA-NeXT and LLaVA-OneVision (anyres): the HF processor's image-token count equals the
model's feature count for every size, and greedy ids equal transformers' (float32) for a mixed
batch (aspect ratios hitting different grid pinpoints, two images in one prompt, token ids),
also with chunked prefill, forced preemption and the transformers-4.x hub layout."""

import pytest
import torch

from conftest import DEVICES, assert_generate_matches_hf, assert_bf16_matches_hf, make_image
from mmkit import LLM
from mmkit.testing.llava_next import build_tiny_anyres
from mmkit.testing import rewrite_hub_layout

VARIANTS = {
    # llava-v1.6-vicuna-like: Llama decoder, CLIP tower, CLS dropped.
    "next-llama-clip": dict(family="llava_next"),
    # llava-v1.6-mistral-like: Mistral decoder, two feature layers concatenated.
    "next-mistral-layers": dict(family="llava_next", text_type="mistral", vision_feature_layer=[-2, -1], seed=1),
    # llava-onevision-qwen2-like: Qwen2 decoder, SigLIP tower, every row, anyres_max, tied.
    "onevision-qwen2-siglip": dict(family="llava_onevision", text_type="qwen2", vision_type="siglip",
                                   select_strategy="full", vision_feature_layer=-1, tie_word_embeddings=True),
}
# (width, height) -> the pinpoint it tiles to: 1x2 (wide), 2x1 (tall), 2x2, 1x3, 3x3 (anyres_max shrinks it).
SIZES = [(40, 30), (20, 60), (64, 64), (100, 30), (200, 190), (33, 33), (7, 90)]
MAX_TOKENS = 33
P1 = "USER: <image>\nWhat is in the image? ASSISTANT:"
P2 = "USER: <image>\nand <image>\nCompare the two. ASSISTANT:"


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    return request.param, build_tiny_anyres(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def test_processor_count_equals_model_feature_count_for_every_size(variant):
    from transformers import AutoProcessor

    _, path = variant
    llm = LLM(str(path), dtype="float32")
    hf_processor = AutoProcessor.from_pretrained(path)
    image_id = llm.llm_engine.config.model.image_token_id
    model = llm.llm_engine.model_runner.model
    processor = llm.llm_engine.input_processor
    for prompt, images in [(P1, [make_image(i, w, h)]) for i, (w, h) in enumerate(SIZES)] + \
                          [(P2, [make_image(1, 40, 30), make_image(2, 20, 60)])]:
        hf_ids = hf_processor(text=prompt, images=hf_images(variant[0], images),
                              return_tensors="pt")["input_ids"][0].tolist()
        processed = processor.process(_parsed(prompt, images))
        assert processed.prompt_token_ids == hf_ids, (prompt, [im.size for im in images])
        with torch.no_grad():
            embeds = model.embed_multimodal([processor.mm_item_inputs(item) for item in processed.images])
        assert [e.shape[0] for e in embeds] == [length for _, length in processed.placeholder_ranges]
        assert sum(t == image_id for t in hf_ids) == sum(e.shape[0] for e in embeds)


def hf_images(name, images):
    """transformers' form of one prompt's images. OneVision lays out the images of a
    multi-image prompt differently (base view only) and learns that from the nesting."""
    return [images] if name.startswith("onevision") and len(images) > 1 else images


def _parsed(prompt, images):
    from mmkit.multimodal.parse import parse_prompt

    return parse_prompt(0, {"prompt": prompt, "multi_modal_data": {"image": images}})


def mixed_batch(tokenizer, name):
    wide, tall, square = make_image(1, 100, 30), make_image(2, 20, 60), make_image(3, 64, 64)
    pair = [make_image(4, 40, 30), make_image(5, 200, 190)]
    inputs = [
        "Write a haiku about the sea.",
        {"prompt": P1, "multi_modal_data": {"image": wide}},
        {"prompt": P1, "multi_modal_data": {"image": tall}},
        {"prompt": P1, "multi_modal_data": {"image": square}},
        {"prompt": P2, "multi_modal_data": {"image": pair}},
        {"prompt_token_ids": tokenizer("Describe the picture").input_ids},
        {"prompt_token_ids": tokenizer(P1).input_ids, "multi_modal_data": {"image": tall}},
    ]
    refs = [dict(prompt="Write a haiku about the sea."), dict(prompt=P1, images=wide), dict(prompt=P1, images=tall),
            dict(prompt=P1, images=square), dict(prompt=P2, images=hf_images(name, pair)), dict(prompt="Describe the picture"),
            dict(prompt=P1, images=tall)]
    return inputs, refs


def check(llm, name, path):
    inputs, refs = mixed_batch(llm.get_tokenizer(), name)
    assert_generate_matches_hf(llm, path, inputs, refs, MAX_TOKENS, cache_key=str(path))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_equals_transformers(variant, device):
    name, path = variant
    check(LLM(str(path), dtype="float32", device=device), name, path)


def test_chunked_prefill_and_forced_preemption(variant):
    name, path = variant
    check(LLM(str(path), dtype="float32", max_num_batched_tokens=16), name, path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=24, block_size=16)
    check(llm, name, path)
    assert llm.get_metrics()["num_preemptions"] >= 1


def test_hub_layout_resave_gives_the_same_ids(variant, tmp_path):
    name, path = variant
    hub = rewrite_hub_layout(path, tmp_path / "hub")
    llm = LLM(str(hub), dtype="float32")
    inputs, refs = mixed_batch(llm.get_tokenizer(), name)
    assert_generate_matches_hf(llm, hub, inputs[1:5], refs[1:5], MAX_TOKENS)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(variant, device):
    """Whole sequences against transformers' own bf16 generate: equal, or first different at a bf16
    tie of transformers' own logits (conftest.assert_bf16_matches_hf)."""
    name, path = variant
    wide, pair = make_image(21, 100, 30), [make_image(22, 64, 64), make_image(23, 20, 60)]
    inputs = ["Write a haiku about the sea.", {"prompt": P1, "multi_modal_data": {"image": wide}},
              {"prompt": P2, "multi_modal_data": {"image": pair}}]
    refs = [dict(prompt=inputs[0]), dict(prompt=P1, images=wide), dict(prompt=P2, images=hf_images(name, pair))]
    num_equal = assert_bf16_matches_hf(path, device, inputs, refs)
    print(f"bf16 sequences equal to transformers' {name} {device}: {num_equal} of {len(refs)}")
