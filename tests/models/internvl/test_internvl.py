"""InternVLForConditionalGeneration (`-HF` layout) on Qwen2 and Qwen3 decoders: greedy ids equal
transformers' (float32) for a mixed batch (text, one image, two images with different tile
counts, token ids), with chunked prefill splitting an image, forced preemption, a prefix-cache
hit, per-request tiling options, the 4.x hub layout; bad inputs refused before anything is added."""

import pytest
import torch

from conftest import _hf_model, make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.internvl import rewrite_internvl_hub_layout

MAX_TOKENS = 34
P1 = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
P2 = "<|im_start|>user\n<IMG_CONTEXT>\nand <IMG_CONTEXT>\nCompare the two.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "Write a haiku about the sea."
ONE = make_image(1, 40, 30)  # 1x1 grid -> 1 tile (no thumbnail)
TWO = [make_image(2, 96, 32), make_image(3, 40, 90)]  # 3x1 and 1x2 grids -> 3 + 1 and 2 + 1 tiles


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def ckpt(request, tmp_path_factory):
    return build_tiny_checkpoint("InternVLForConditionalGeneration", tmp_path_factory.mktemp(request.param),
                                 text_type=request.param, head_dim=24 if request.param == "qwen3" else None,
                                 seed=1)


def hf_ids(path, prompt=None, images=None, input_ids=None, **processor_kwargs):
    """transformers' own greedy generate with its processor (exactly MAX_TOKENS new tokens)."""
    model, processor = _hf_model(str(path))
    if prompt is not None:
        inputs = processor(text=prompt, images=images, return_tensors="pt", **processor_kwargs)
    else:
        inputs = {"input_ids": torch.tensor([input_ids])}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


_REFS: dict = {}


def mixed(llm, path):
    """(inputs, reference ids): text, one image, two images of different tile counts, token ids
    (text only, and an image's single placeholder)."""
    tok = llm.get_tokenizer()
    inputs = [TEXT, {"prompt": P1, "multi_modal_data": {"image": ONE}},
              {"prompt": P2, "multi_modal_data": {"image": TWO}},
              {"prompt_token_ids": tok(TEXT).input_ids},
              {"prompt_token_ids": tok(P1).input_ids, "multi_modal_data": {"image": ONE}}]
    key = str(path)
    if key not in _REFS:
        _REFS[key] = [hf_ids(path, TEXT), hf_ids(path, P1, ONE), hf_ids(path, P2, TWO),
                      hf_ids(path, input_ids=tok(TEXT).input_ids), hf_ids(path, P1, ONE)]
    return inputs, _REFS[key]


def check(llm, path):
    inputs, refs = mixed(llm, path)
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"inputs[{i}]"
    return outs


def test_mixed_batch_equals_transformers(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    outs = check(llm, ckpt)
    # The prompts expanded exactly as InternVLProcessor expands them; the two images of P2 take
    # different tile counts (3 tiles + thumbnail, 2 tiles + thumbnail; 4 tokens per tile).
    _, processor = _hf_model(str(ckpt))
    for i, (prompt, images) in {1: (P1, ONE), 2: (P2, TWO)}.items():
        assert outs[i].prompt_token_ids == processor(text=prompt, images=images).input_ids[0]
    assert outs[2].prompt_token_ids.count(llm.llm_engine.config.model.image_token_id) == (4 + 3) * 4


def test_chunked_prefill_preemption_and_prefix_cache(ckpt):
    # 8-token steps split every image's 12-16 placeholder run.
    check(LLM(str(ckpt), dtype="float32", max_num_batched_tokens=8), ckpt)
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=14, block_size=8)
    check(llm, ckpt)
    assert llm.get_metrics()["num_preemptions"] >= 1
    llm = LLM(str(ckpt), dtype="float32", block_size=4, enable_prefix_caching=True)
    check(llm, ckpt)
    before = llm.get_metrics()["prefix_cache_hits"]
    check(llm, ckpt)  # the same prompts again: their image blocks come from the prefix cache
    assert llm.get_metrics()["prefix_cache_hits"] > before


def test_mm_processor_kwargs_change_one_requests_tiling(ckpt):
    # Block size 4: the first image blocks of the three requests hold the same token ids, so only
    # the options in the item's hash keep a later call from reusing an earlier call's KV blocks
    # (and the encoder cache from reusing its embedding).
    llm = LLM(str(ckpt), dtype="float32", enable_prefix_caching=True, block_size=4)
    image = TWO[0]  # 96x32: 3 tiles + thumbnail by default
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    options = [None, {"max_patches": 2}, {"crop_to_patches": False}]
    outs = [llm.generate({"prompt": P1, "multi_modal_data": {"image": image}, "mm_processor_kwargs": o},
                         params, use_tqdm=False)[0] for o in options]
    context = llm.llm_engine.config.model.image_token_id
    assert [o.prompt_token_ids.count(context) for o in outs] == [16, 12, 4]  # 4 tokens per tile
    _, processor = _hf_model(str(ckpt))
    assert outs[1].prompt_token_ids == processor(text=P1, images=image, max_patches=2).input_ids[0]
    assert outs[0].outputs[0].token_ids == hf_ids(ckpt, P1, image)
    assert outs[1].outputs[0].token_ids == hf_ids(ckpt, P1, image, max_patches=2)
    assert outs[2].outputs[0].token_ids == hf_ids(ckpt, P1, image, crop_to_patches=False)
    # Engine-wide options apply to every request (and a request's own override them).
    engine = LLM(str(ckpt), dtype="float32", mm_processor_kwargs={"crop_to_patches": False})
    out = engine.generate({"prompt": P1, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_hub_layout_resave_gives_the_same_ids(ckpt, tmp_path):
    hub = rewrite_internvl_hub_layout(ckpt, tmp_path / "hub")
    llm = LLM(str(hub), dtype="float32")
    inputs, _ = mixed(llm, ckpt)
    outs = llm.generate(inputs[:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    # bf16 weights upcast by both: compared with transformers on the same files.
    refs = [hf_ids(hub, TEXT), hf_ids(hub, P1, ONE), hf_ids(hub, P2, TWO)]
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_image_embeddings_as_input(ckpt):
    from mmkit.models.internvl import InternVLForConditionalGeneration

    model, processor = _hf_model(str(ckpt))
    pixels = processor.image_processor(images=[ONE], return_tensors="pt", crop_to_patches=True)["pixel_values"]
    with torch.no_grad():
        embeds = model.model.get_image_features(pixel_values=pixels).pooler_output.reshape(1, -1, 64)
    assert InternVLForConditionalGeneration.get_num_placeholder_tokens(
        model.config, (40, 30), num_tiles=pixels.shape[0]) == embeds.shape[1]
    llm = LLM(str(ckpt), dtype="float32")
    out = llm.generate({"prompt": P1, "multi_modal_data": {"image_embeds": embeds}},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_ids(ckpt, P1, ONE)


def test_bad_inputs_are_refused_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32", limit_mm_per_prompt={"image": 1})
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"inputs\[1\]\.multi_modal_data: got 2 images; expected at most "
                                         r"limit_mm_per_prompt\['image'\] = 1"):
        llm.generate([TEXT, {"prompt": P2, "multi_modal_data": {"image": TWO}}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"inputs\[1\]\.mm_processor_kwargs: unknown key\(s\) \['max_pixels'\]; "
                                         r"expected only \['min_patches', 'max_patches', 'crop_to_patches'\]"):
        llm.generate([TEXT, {"prompt": P1, "multi_modal_data": {"image": ONE},
                             "mm_processor_kwargs": {"max_pixels": 10}}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"inputs\[0\]\.mm_processor_kwargs\['max_patches'\]: got 0"):
        llm.generate({"prompt": P1, "multi_modal_data": {"image": ONE}, "mm_processor_kwargs": {"max_patches": 0}},
                     params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^mm_processor_kwargs: unknown key\(s\) \['fps'\]"):
        LLM(str(ckpt), dtype="float32", mm_processor_kwargs={"fps": 2})
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(TEXT, params, use_tqdm=False)[0].request_id is not None
