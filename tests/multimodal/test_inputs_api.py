"""The consolidated-inputs API (vLLM's behaviours) and the legacy keyword arguments."""

import warnings

import pytest
import torch

from conftest import get_llm, hf_greedy, make_image, pil_to_tensor
from mmkit import LLM, MultiModalData, SamplingParams
from mmkit.multimodal.items import ImageItem

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
TEXTS = ["Hello there", "A much longer prompt about the sea and the sky", "Count: 1 2 3"]


def texts(outs):
    return [o.outputs[0].text for o in outs]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


def test_one_string_one_output(llm):
    outs = llm.generate("Hello there", GREEDY, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt == "Hello there" and outs[0].finished


def test_batch_in_input_order(llm):
    outs = llm.generate(TEXTS, [SamplingParams(temperature=0, max_tokens=m) for m in (20, 2, 9)], use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS
    singles = [llm.generate(t, SamplingParams(temperature=0, max_tokens=m), use_tqdm=False)[0]
               for t, m in zip(TEXTS, (20, 2, 9))]
    assert ids(outs) == ids(singles)


def test_string_and_dict_equal(llm):
    assert ids(llm.generate("p", GREEDY, use_tqdm=False)) == ids(llm.generate({"prompt": "p"}, GREEDY, use_tqdm=False))


def test_token_ids_round_trip(llm):
    prompt_ids = [1, 20, 30, 40, 50]
    out = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt_ids and out.prompt is None


def test_mixed_batch_all_forms(llm, tiny_ckpt):
    img = make_image(2)
    image_prompt = {"prompt": PROMPT, "multi_modal_data": MultiModalData(type=MultiModalData.Type.IMAGE, data=img)}
    batch = ["A plain text prompt", image_prompt, {"prompt_token_ids": [1, 33, 44]}]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    alone = llm.generate(image_prompt, GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt=PROMPT, images=img, max_new_tokens=8)
    assert outs[2].prompt_token_ids == [1, 33, 44]


def test_new_style_emits_no_deprecation(llm):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        llm.generate(["a", {"prompt": "b"}, {"prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kwargs,name,new", [
    ({"prompts": TEXTS}, "prompts", lambda: TEXTS),
    ({"prompt": "Hello there"}, "prompt", lambda: {"prompt": "Hello there"}),
    ({"prompts": "Hello there"}, "prompts", lambda: "Hello there"),
    ({"prompt_token_ids": [[1, 5, 6], [1, 7]]}, "prompt_token_ids",
     lambda: [{"prompt_token_ids": [1, 5, 6]}, {"prompt_token_ids": [1, 7]}]),
])
def test_legacy_arguments_warn_and_match(llm, kwargs, name, new):
    with pytest.warns(DeprecationWarning) as record:
        old = llm.generate(sampling_params=GREEDY, use_tqdm=False, **kwargs)
    messages = [str(w.message) for w in record]
    assert any(f"{name}=" in m and "inputs" in m for m in messages)
    assert all(w.filename == __file__ for w in record)  # points at the caller's line
    assert ids(old) == ids(llm.generate(new(), GREEDY, use_tqdm=False))


def test_legacy_multi_modal_rows_go_to_each_prompt(llm):
    imgs = [make_image(20), make_image(21)]
    batch = torch.stack([pil_to_tensor(i) for i in imgs])  # [2, 3, H, W]
    with pytest.warns(DeprecationWarning) as record:
        old = llm.generate(prompts=[PROMPT, PROMPT], sampling_params=GREEDY, use_tqdm=False,
                           multi_modal_data=MultiModalData(type=MultiModalData.Type.IMAGE, data=batch))
    messages = [str(w.message) for w in record]
    assert any("prompts=" in m for m in messages) and any("multi_modal_data=" in m for m in messages)
    new = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs], GREEDY,
                       use_tqdm=False)
    assert ids(old) == ids(new)
    with pytest.raises(ValueError, match="3 prompts"), pytest.warns(DeprecationWarning):
        llm.generate(prompts=[PROMPT] * 3, multi_modal_data=MultiModalData(type=MultiModalData.Type.IMAGE, data=batch),
                     use_tqdm=False)


def test_legacy_errors(llm):
    with pytest.raises(ValueError, match="same length"), pytest.warns(DeprecationWarning):
        llm.generate(prompts=["a", "b"], prompt_token_ids=[[1, 2]], use_tqdm=False)
    with pytest.raises(ValueError, match="inputs"):
        llm.generate(use_tqdm=False)


def test_short_sampling_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(TEXTS, [GREEDY, GREEDY], use_tqdm=False)


@pytest.mark.parametrize("bad", [[], [[]]])
def test_empty_inputs_are_errors(llm, bad):
    with pytest.raises((ValueError, TypeError)):
        llm.generate(bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("bad,match", [
    ({"promt": "typo"}, "unknown key"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "both"),
    ({"multi_modal_data": {"image": None}}, "neither"),
    ({"prompt": ""}, "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 10**7]}, "token id"),
    ({"prompt": 5}, "str"),
])
def test_bad_prompts_name_the_index(llm, bad, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        llm.generate(["fine", bad], GREEDY, use_tqdm=False)
    assert "inputs[1]" in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("fine", GREEDY, use_tqdm=False)[0].finished


def test_placeholder_count_mismatch(llm):
    img = make_image(1)
    with pytest.raises(ValueError) as info:
        llm.generate(["ok", {"prompt": PROMPT, "multi_modal_data": {"image": [img, img]}}], GREEDY, use_tqdm=False)
    msg = str(info.value)
    assert "inputs[1]" in msg and "1 image placeholder" in msg and "2 image" in msg
    with pytest.raises(ValueError, match="0 image"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": img}}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)[0].finished


def test_image_embeds_skip_the_vision_tower(llm, tiny_ckpt):
    img = make_image(8)
    runner = llm.llm_engine.model_runner
    pv = llm.llm_engine.input_processor.pixel_values([ImageItem(img, 40, 30)])
    with torch.no_grad():
        embeds = runner.model.encode_images(pv)
    before = runner.num_vision_calls
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": MultiModalData(
        type=MultiModalData.Type.IMAGE_EMBEDS, data=embeds)}, GREEDY, use_tqdm=False)
    assert runner.num_vision_calls == before
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt=PROMPT, images=img, max_new_tokens=8)
    with pytest.raises(ValueError, match="image_seq_length"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image_embeds": embeds[:, :3]}}, use_tqdm=False)


def test_generated_image_token_is_ordinary(llm):
    # A token-id prompt ending in the image token id with no image: refused (count check) ...
    image_id = llm.llm_engine.config.model.image_token_id
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt_token_ids": [1, image_id]}, use_tqdm=False)


def test_unsupported_architecture(tmp_path, tiny_ckpt):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyVLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration"):
        LLM(str(bad))


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="never downloads"):
        LLM("org/not-a-cached-model")
