"""LoRA on the vision tower and projector (enable_tower_connector_lora) and on tiny Qwen2-VL,
against PEFT's PeftModel (applied, not merged), float32 greedy ids."""

from __future__ import annotations

import pytest

from conftest import make_image
from lora_ref import peft_greedy
from mmkit import LLM, LoRARequest, SamplingParams
from mmkit.testing.lora import DECODER_REGEX, build_peft_adapter, rewrite_v4_keys

N = 10
IMG = make_image(7, 40, 30)
LLAVA_PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
QWEN_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the image?<|im_end|>\n"
               "<|im_start|>assistant\n")


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def ids(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_tower_and_projector_adapter_caches_embeddings_per_adapter(tiny_ckpt, tmp_path):
    tower = build_peft_adapter(tiny_ckpt, tmp_path / "tower", seed=31, r=8, lora_alpha=16, target_modules=(
        r".*vision_tower.*\.(q_proj|v_proj|fc1)|.*multi_modal_projector\.linear_1|" + DECODER_REGEX[2:]))
    llm = LLM(str(tiny_ckpt), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              enable_tower_connector_lora=True)
    runner = llm.llm_engine.model_runner
    lora = LoRARequest("tower", 1, str(tower))
    inp = {"prompt": LLAVA_PROMPT, "multi_modal_data": {"image": IMG}}
    base_ref = peft_greedy(tiny_ckpt, None, LLAVA_PROMPT, [IMG], max_new_tokens=N)
    lora_ref = peft_greedy(tiny_ckpt, tower, LLAVA_PROMPT, [IMG], max_new_tokens=N)
    assert base_ref != lora_ref
    calls = runner.num_vision_calls
    outs = llm.generate([inp, inp], greedy(), lora_request=[None, lora], use_tqdm=False)
    assert [ids(o) for o in outs] == [base_ref, lora_ref]
    assert runner.num_vision_calls == calls + 2  # one image, encoded once per adapter
    again = llm.generate([inp, inp], greedy(), lora_request=[lora, None], use_tqdm=False)
    assert [ids(o) for o in again] == [lora_ref, base_ref]


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    from mmkit.testing.qwen2_vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen_lora"), version="2", seed=3)


def test_qwen2_vl_adapters_with_and_without_image(qwen_ckpt, tmp_path):
    a = build_peft_adapter(qwen_ckpt, tmp_path / "qa", seed=41, target_modules=DECODER_REGEX + r"|lm_head")
    # 4.x Qwen-VL names: base_model.model.model.layers.* (the decoder was `model`)
    a_v4 = rewrite_v4_keys(a, tmp_path / "qa_v4",
                           lambda k: k.replace("base_model.model.model.language_model.", "base_model.model.model."))
    llm = LLM(str(qwen_ckpt), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    text = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
    image = {"prompt": QWEN_PROMPT, "multi_modal_data": {"image": IMG}}
    ra, ra4 = LoRARequest("qa", 1, str(a)), LoRARequest("qa4", 2, str(a_v4))
    outs = llm.generate([text, image, image, text], greedy(), lora_request=[ra, ra, None, ra4], use_tqdm=False)
    want_text = peft_greedy(qwen_ckpt, a, text, max_new_tokens=N)
    assert ids(outs[0]) == want_text == ids(outs[3])
    assert ids(outs[1]) == peft_greedy(qwen_ckpt, a, QWEN_PROMPT, [IMG], max_new_tokens=N)
    assert ids(outs[2]) == peft_greedy(qwen_ckpt, None, QWEN_PROMPT, [IMG], max_new_tokens=N)
    assert ids(outs[1]) != ids(outs[2])
