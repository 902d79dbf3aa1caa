"""Every family on its second tiny configuration (`SECOND_CONFIGS` in each `mmkit.testing.<family>`
module: another decoder or tower where the family allows, tie flags set differently at the two
config levels, GQA ratio 3, odd head sizes, uneven M-RoPE sections, MoE in alternate layers,
sliding windows the prompts outgrow, no BOS): greedy ids equal transformers' generate for text
only, one image and a mixed batch. Builders that make one shape hide bugs; this is the other."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from conftest import _hf_model, make_image
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint

N = 12
QWEN = ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<|vision_start|><|image_pad|><|vision_end|>")
# family module -> (chat wrapper, image placeholder, whether transformers' processor takes the
# prompt's images nested per prompt)
FAMILIES = {
    "llava": ("USER: {} ASSISTANT:", "<image>\n", True),
    "llava_next": ("USER: {} ASSISTANT:", "<image>\n", True),
    "qwen2_vl": (*QWEN, False),
    "qwen3_vl": (*QWEN, False),
    "gemma3": ("<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n", "<start_of_image>", True),
    "idefics3": ("User:{}<end_of_utterance>\nAssistant:", "<image>", True),
    "internvl": ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<IMG_CONTEXT>\n", True),
    "mistral3": ("[INST]{}[/INST]", "[IMG]", True),
    "qwen3_5": (*QWEN, False),
    "lfm2_vl": ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<image>", True),
}
CASES = {"text": [0], "image": [1], "mixed": [0, 1, 2]}
SECOND = {arch: (family, kwargs) for family in FAMILIES
          for arch, kwargs in importlib.import_module(f"mmkit.testing.{family}").SECOND_CONFIGS.items()}


def prompts(family: str) -> list[tuple[str, list | None]]:
    """(prompt, images): text only, one image, two images of other sizes."""
    chat, image, _ = FAMILIES[family]
    return [(chat.format("Write a haiku about the sea."), None),
            (chat.format(f"{image}What is in the image?"), [make_image(2, 90, 50)]),
            (chat.format(f"{image} and {image}Compare the two."), [make_image(1, 40, 30), make_image(3, 20, 70)])]


@pytest.fixture(scope="module", params=sorted(SECOND))
def second(request, tmp_path_factory):
    family, kwargs = SECOND[request.param]
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp("second"), seed=5, **kwargs)
    return family, path, LLM(str(path), dtype="float32"), {}


def hf_ids(family: str, path, prompt: str, images) -> list[int]:
    """transformers' greedy generate, exactly N tokens (EOS neither stops nor is masked, as
    mmkit's ignore_eos)."""
    model, processor = _hf_model(str(path))
    kwargs = {} if images is None else {"images": [images] if FAMILIES[family][2] else images}
    inputs = processor(text=[prompt], return_tensors="pt", **kwargs)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.max_new_tokens, config.do_sample = [], N, False
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_second_config_greedy_equals_transformers(second, case):
    family, path, llm, refs = second
    table = prompts(family)
    picked = [table[i] for i in CASES[case]]
    inputs = [p if ims is None else {"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in picked]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    for i, out in zip(CASES[case], outs):
        if i not in refs:
            refs[i] = hf_ids(family, path, *table[i])
        assert list(out.outputs[0].token_ids) == refs[i], (case, i)
    # every prompt gets its own answer: the images and the text matter
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(outs)
