"""LLaVA-NeXT / OneVision through the engine's features: encoder and prefix caches (keys cover
the image content and its token layout), n > 1, legacy inputs, already expanded token ids,
and the clear errors (too many images, count mismatches, video, unsupported architectures)."""

import json
import shutil

import pytest

from conftest import hf_greedy, make_image, pil_to_tensor
from mmkit import LLM, MultiModalData, SamplingParams
from mmkit.testing.llava_next import build_tiny_anyres

P1 = "USER: <image>\nWhat is in the image? ASSISTANT:"
P2 = "USER: <image>\nand <image>\nCompare the two. ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAMILIES = {"next": dict(family="llava_next", seed=2),
            "onevision": dict(family="llava_onevision", text_type="qwen2", vision_type="siglip",
                              select_strategy="full", vision_feature_layer=-1, seed=2)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def ckpt(request, tmp_path_factory):
    return request.param, build_tiny_anyres(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])


def ref(path, prompt, images):
    return hf_greedy(path, prompt=prompt, images=images, max_new_tokens=12, ignore_eos=True)


def ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_caches_n_and_legacy_inputs(ckpt):
    name, path = ckpt
    llm = LLM(str(path), dtype="float32")
    image, other = make_image(11, 100, 30), make_image(12, 30, 70)
    single = {"prompt": P1, "multi_modal_data": {"image": image}}
    expected = ref(path, P1, image)
    assert ids(llm.generate(single, GREEDY, use_tqdm=False)) == [expected]
    before = llm.get_metrics()
    assert ids(llm.generate(single, GREEDY, use_tqdm=False)) == [expected]
    after = llm.get_metrics()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    # The same image inside a two-image prompt: OneVision lays it out differently (base view),
    # so neither the encoder cache nor the prefix cache may reuse the single-image entries.
    pair = {"prompt": P2, "multi_modal_data": {"image": [image, other]}}
    hf_pair = [[image, other]] if name == "onevision" else [image, other]
    assert ids(llm.generate(pair, GREEDY, use_tqdm=False)) == [ref(path, P2, hf_pair)]
    # Encoder cache across calls (prefix cache off so the image must be merged again).
    uncached = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    uncached.generate(single, GREEDY, use_tqdm=False)
    hits = uncached.get_metrics()["encoder_cache_hits"]
    assert ids(uncached.generate(single, GREEDY, use_tqdm=False)) == [expected]
    assert uncached.get_metrics()["encoder_cache_hits"] > hits
    # n > 1 (greedy: every sample is the reference).
    out = llm.generate(single, SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(c.token_ids) for c in out[0].outputs] == [expected, expected]
    # Legacy keyword arguments: one tensor row per prompt.
    with pytest.warns(DeprecationWarning):
        old = llm.generate(prompts=[P1], sampling_params=GREEDY, use_tqdm=False,
                           multi_modal_data=MultiModalData(type=MultiModalData.Type.IMAGE,
                                                           data=pil_to_tensor(image)[None]))
    assert ids(old) == [expected]


def test_expanded_token_ids_equal_the_text_prompt(ckpt):
    from transformers import AutoProcessor

    _, path = ckpt
    llm = LLM(str(path), dtype="float32")
    image = make_image(13, 20, 60)
    expanded = AutoProcessor.from_pretrained(path)(text=P1, images=image)["input_ids"][0]
    once = llm.get_tokenizer()(P1).input_ids
    outs = llm.generate([{"prompt_token_ids": list(expanded), "multi_modal_data": {"image": image}},
                         {"prompt_token_ids": once, "multi_modal_data": {"image": image}}], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == list(expanded)
    assert ids(outs) == [ref(path, P1, image)] * 2
    image_id = llm.llm_engine.config.model.image_token_id
    bad = list(expanded)
    bad.insert(bad.index(image_id), image_id)  # one token too many
    with pytest.raises(ValueError, match=r"inputs\[0\]: a run of .* image tokens"):
        llm.generate({"prompt_token_ids": bad, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)


def test_bad_inputs_are_clear_errors(ckpt):
    name, path = ckpt
    llm = LLM(str(path), dtype="float32", limit_mm_per_prompt={"image": 1})
    two = [make_image(1), make_image(2)]
    with pytest.raises(ValueError, match=r"inputs\[0\].*2 images.*limit_mm_per_prompt\['image'\] = 1"):
        llm.generate({"prompt": P2, "multi_modal_data": {"image": two}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"inputs\[1\].*1 image placeholder.*2 image"):
        LLM(str(path), dtype="float32").generate(
            ["ok", {"prompt": P1, "multi_modal_data": {"image": two}}], GREEDY, use_tqdm=False)
    if name == "onevision":
        with pytest.raises(ValueError, match=r"inputs\[0\].*video.*not supported yet"):
            llm.generate("USER: <video>\nWhat happens? ASSISTANT:", GREEDY, use_tqdm=False)
    assert llm.generate("still usable", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_processor_model_mismatch_fails_loudly(ckpt, tmp_path):
    """A processor whose pinpoints do not match the model's config must not misalign."""
    _, path = ckpt
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["image_grid_pinpoints"] = [[32, 64], [64, 32]]  # the processor still tiles up to 3x3
    (bad / "config.json").write_text(json.dumps(config))
    llm = LLM(str(bad), dtype="float32")
    with pytest.raises(ValueError, match=r"inputs\[0\]\.multi_modal_data\[0\]: for an image of 64x64 .*processor "
                                         r"expands \d+ image tokens but the model produces \d+ features"):
        llm.generate({"prompt": P1, "multi_modal_data": {"image": make_image(3, 64, 64)}}, GREEDY, use_tqdm=False)


def test_unsupported_architecture_lists_every_family(tmp_path, ckpt):
    _, path = ckpt
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["LlavaNextVideoForConditionalGeneration"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LLM(str(bad))
    for arch in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                 "LlavaOnevisionForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"):
        assert arch in str(err.value)


def test_processor_config_without_patch_size_uses_the_model_config(ckpt, tmp_path):
    """Processor configs saved before `patch_size` / `vision_feature_select_strategy` existed."""
    name, path = ckpt
    old = tmp_path / "old"
    shutil.copytree(path, old)
    proc = json.loads((old / "processor_config.json").read_text())
    for key in ("patch_size", "vision_feature_select_strategy", "num_image_tokens"):
        proc.pop(key, None)
    (old / "processor_config.json").write_text(json.dumps(proc))
    image = make_image(14, 64, 40)
    out = LLM(str(old), dtype="float32").generate({"prompt": P1, "multi_modal_data": {"image": image}}, GREEDY,
                                                  use_tqdm=False)
    assert ids(out) == [ref(path, P1, image)]


def test_image_embeds_input_equals_the_image(ckpt):
    """IMAGE_EMBEDS of an anyres image (its own token count) skip the tower, same ids."""
    import torch

    name, path = ckpt
    llm = LLM(str(path), dtype="float32")
    image = make_image(15, 90, 40)
    processor = llm.llm_engine.input_processor
    parsed_item = processor.process(_one_image_prompt(image)).images[0]
    with torch.no_grad():
        embeds = llm.llm_engine.model_runner.model.embed_multimodal([processor.mm_item_inputs(parsed_item)])[0]
    via_embeds = llm.generate({"prompt": P1, "multi_modal_data": MultiModalData(
        type=MultiModalData.Type.IMAGE_EMBEDS, data=embeds[None])}, GREEDY, use_tqdm=False)
    assert ids(via_embeds) == [ref(path, P1, image)]


def _one_image_prompt(image):
    from mmkit.multimodal.parse import parse_prompt

    return parse_prompt(0, {"prompt": P1, "multi_modal_data": {"image": image}})
