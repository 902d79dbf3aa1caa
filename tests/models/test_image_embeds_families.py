"""Image embeddings as input for every architecture `build_tiny_checkpoint` builds: the model's own
embeddings of an image (mmkit's `embed_multimodal` rows for the item; the span families' image-token
rows only), given back in the family's documented form (docs/models.md, "Image embeddings"),
give the greedy ids of the image itself; `LLM.chat` takes them as vLLM's `image_embeds` parts
(base64 of `torch.save`); a wrong shape fails before anything is added, naming the expected one."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.multimodal.parse import parse_inputs
from mmkit.testing import build_tiny_checkpoint, tiny_architectures

N = 8
SPAN_FAMILIES = ("Mistral3", "Idefics3", "SmolVLM", "Gemma3", "Lfm2Vl")
# Sizes that tile / cut rows: Idefics3 and SmolVLM split it, Pixtral writes several rows.
IMG, IMG2 = make_image(1, 90, 50), make_image(2, 40, 70)


def greedy(max_tokens=N):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def chat_prompt(llm, num_images=1) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": "Hi"}]}]
    return _render(llm, messages)


def _render(llm, messages):
    from mmkit.entrypoints.chat_utils import render

    proc = llm.llm_engine.input_processor
    prompt = render(proc.hf_processor or proc.tokenizer, messages, None, True)
    bos = proc.tokenizer.bos_token
    return prompt[len(bos):] if bos and prompt.startswith(bos) else prompt


def own_embeds(llm, prompt, images, mm_processor_kwargs=None):
    """The model's own rows for `images`, in the family's input form for `multi_modal_data`."""
    proc = llm.llm_engine.input_processor
    model = llm.llm_engine.model_runner.model
    parsed = parse_inputs({"prompt": prompt, "multi_modal_data": {"image": images},
                           **({"mm_processor_kwargs": mm_processor_kwargs} if mm_processor_kwargs else {})})[0]
    processed = proc.process(parsed)
    rows, sizes, grids = [], [], []
    for item in processed.images:
        inputs = proc.mm_item_inputs(item)
        with torch.no_grad():
            out = model.embed_multimodal([inputs])[0]
        if "span_ids" in inputs:  # a span family: the image-token rows only
            out = out[inputs["span_ids"] == proc.image_token_id]
            sizes.append([item.frames[0].height, item.frames[0].width])
        if "grid_thw" in inputs:  # Qwen-VL: the image processor's image_grid_thw
            grids.append(inputs["grid_thw"].reshape(1, 3))
        rows.append(out)
    if sizes:
        return {"image": {"image_embeds": torch.cat(rows), "image_sizes": torch.tensor(sizes)}}
    if grids:
        return {"image": {"image_embeds": torch.cat(rows), "image_grid_thw": torch.cat(grids)}}
    return {"image_embeds": torch.stack(rows)}  # [N, tokens, hidden]


@pytest.fixture(scope="module", params=tiny_architectures())
def llm(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param[:9]))
    return LLM(str(path), dtype="float32", max_num_seqs=4)


def test_own_embeddings_give_the_image_ids(llm):
    prompt = chat_prompt(llm)
    given = own_embeds(llm, prompt, [IMG])
    calls = llm.llm_engine.model_runner.num_vision_calls
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": IMG}},
                         {"prompt": prompt, "multi_modal_data": given}], greedy(), use_tqdm=False)
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[1].prompt_token_ids == outs[0].prompt_token_ids
    assert llm.llm_engine.model_runner.num_vision_calls == calls + 1  # the image only


def test_span_families_take_image_sizes(llm):
    """Two images of different sizes (Pixtral rows, Idefics3 tiles) as one [sum, hidden] tensor."""
    name = llm.llm_engine.input_processor.model_config.architecture
    if not name.startswith(SPAN_FAMILIES):
        pytest.skip("a span family's layout")
    prompt = chat_prompt(llm, 2)
    given = own_embeds(llm, prompt, [IMG, IMG2])
    ids = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [IMG, IMG2]}},
                        {"prompt": prompt, "multi_modal_data": given}], greedy(), use_tqdm=False)
    assert ids[1].outputs[0].token_ids == ids[0].outputs[0].token_ids
    if name.startswith("Gemma3"):  # pan-and-scan crops: the sizes and options fix the views
        kw = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
        wide = make_image(3, 120, 40)
        one = chat_prompt(llm)
        crops = own_embeds(llm, one, [wide], kw)
        outs = llm.generate([{"prompt": one, "multi_modal_data": {"image": wide}, "mm_processor_kwargs": kw},
                             {"prompt": one, "multi_modal_data": crops, "mm_processor_kwargs": kw}],
                            greedy(), use_tqdm=False)
        assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert len(outs[0].prompt_token_ids) > len(ids[0].prompt_token_ids) // 2 + 8  # crops were written


def test_bad_shape_fails_before_anything_is_added(llm):
    prompt = chat_prompt(llm)
    given = own_embeds(llm, prompt, [IMG])
    if "image" in given:
        data = dict(given["image"])
        data["image_embeds"] = data["image_embeds"][:-1]
        bad = {"image": data}
    else:  # LLaVA-NeXT / OneVision take the token count as given: a wrong width
        bad = {"image_embeds": given["image_embeds"][..., :-1]}
    ok = {"prompt": prompt, "multi_modal_data": {"image": IMG}}
    with pytest.raises(ValueError, match=r"inputs\[1\]\.multi_modal_data.*got .*shape.*expected"):
        llm.generate([ok, {"prompt": prompt, "multi_modal_data": bad}], greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def _b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_chat_image_embeds_parts(llm):
    """vLLM's chat part: base64 of torch.save, a dict of them where the family reads fields."""
    given = own_embeds(llm, chat_prompt(llm), [IMG])
    if "image" in given:
        part = {key: _b64(value) for key, value in given["image"].items()}
    else:
        part = _b64(given["image_embeds"][0])
    text = {"type": "text", "text": "Hi"}
    with_image = llm.chat([{"role": "user", "content": [{"type": "image", "image": IMG}, text]}], greedy(),
                          use_tqdm=False)[0]
    with_embeds = llm.chat([{"role": "user", "content": [{"type": "image_embeds", "image_embeds": part}, text]}],
                           greedy(), use_tqdm=False)[0]
    assert with_embeds.outputs[0].token_ids == with_image.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"image and image_embeds parts"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": IMG},
                                               {"type": "image_embeds", "image_embeds": part}, text]}],
                 greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"not base64"):
        llm.chat([{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "%%%"}, text]}],
                 greedy(), use_tqdm=False)
