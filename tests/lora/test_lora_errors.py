"""Bad LoRA input: a clear ValueError before anything of the call is added; the next call works."""

from __future__ import annotations

import pytest

from mmkit import LLM, LoRARequest, SamplingParams
from mmkit.testing.lora import build_peft_adapter, edit_adapter_config

TEXT = "USER: Hello there. ASSISTANT:"
SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_loras")
    good = build_peft_adapter(tiny_ckpt, root / "good", seed=1, r=4, lora_alpha=8)
    rank16 = build_peft_adapter(tiny_ckpt, root / "rank16", seed=2, r=16, lora_alpha=16)
    tower = build_peft_adapter(tiny_ckpt, root / "tower", seed=3, r=4, lora_alpha=8,
                               target_modules=r".*vision_tower.*\.q_proj|.*multi_modal_projector\.linear_1")
    llm = LLM(str(tiny_ckpt), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    return llm, good, rank16, tower, root


def check_refused(llm, match, lora_request, inputs=(TEXT, TEXT)):
    with pytest.raises(ValueError, match=match):
        llm.generate(list(inputs), SP, lora_request=lora_request, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_errors_name_the_cause(setup, tmp_path):
    llm, good, rank16, tower, root = setup
    ok = LoRARequest("good", 1, str(good))
    check_refused(llm, r"inputs\[1\].*lora_path: '/nonexistent/adapter' does not exist",
                  [ok, LoRARequest("gone", 2, "/nonexistent/adapter")])
    check_refused(llm, r"rank 16 is above max_lora_rank = 8", [None, LoRARequest("big", 3, str(rank16))])
    check_refused(llm, r"enable_tower_connector_lora=True", LoRARequest("tower", 4, str(tower)))
    check_refused(llm, r"lora_request: got a list of 3; expected one LoRARequest or a list of 2", [ok, ok, None])
    # a target module the model lacks (a layer index past the model's two layers, and a config name)
    lacks = root / "lacks"
    if not lacks.exists():
        import shutil

        from safetensors.torch import load_file, save_file
        shutil.copytree(good, lacks)
        state = load_file(str(lacks / "adapter_model.safetensors"))
        state = {k.replace("layers.1.", "layers.7."): v for k, v in state.items()}
        save_file(state, str(lacks / "adapter_model.safetensors"))
    check_refused(llm, r"target module 'language_model.layers.7.[a-z_.]+' is not a module of this model",
                  LoRARequest("lacks", 5, str(lacks)))
    named = tmp_path / "named"
    import shutil
    shutil.copytree(good, named)
    edit_adapter_config(named, target_modules=["q_proj", "c_attn"])
    check_refused(llm, r"target module 'c_attn' is not a module of this model", LoRARequest("named", 6, str(named)))
    with pytest.raises(ValueError, match="lora_int_id: got 0"):
        LoRARequest("zero", 0, str(good))
    # the engine still works, with and without the adapter
    outs = llm.generate([TEXT, TEXT], SP, lora_request=[ok, None], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_lora_request_without_enable_lora(tiny_ckpt, setup):
    _, good, *_ = setup
    from conftest import get_llm

    plain = get_llm(tiny_ckpt)
    check_refused(plain, r"inputs\[0\].*built without LoRA; pass enable_lora=True",
                  LoRARequest("good", 1, str(good)), inputs=(TEXT,))
    with pytest.raises(ValueError, match="max_cpu_loras: got 1; expected at least max_loras = 2"):
        LLM(str(tiny_ckpt), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=1)
