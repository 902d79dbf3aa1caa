"""Checkpoint resolution and weight-name normalization; a generated image-token id is ordinary."""

import shutil

import pytest
import torch

from conftest import get_llm, hf_greedy, resave_checkpoint
from mmkit import LLM, SamplingParams
from mmkit.models.checkpoint_keys import transformers_key_mapper
from mmkit.testing import hub_key


LAYOUT_ROWS = [
    # transformers 4.x hub layout (llava-hf/llava-1.5-7b-hf)
    ("language_model.model.layers.0.self_attn.q_proj.weight", "language_model.layers.0.self_attn.q_proj.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("vision_tower.vision_model.embeddings.class_embedding", "vision_tower.embeddings.class_embedding"),
    ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
     "vision_tower.encoder.layers.0.self_attn.q_proj.weight"),
    # what transformers 5 saves (no vision_model level)
    ("vision_tower.embeddings.patch_embedding.weight", "vision_tower.embeddings.patch_embedding.weight"),
    ("multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias"),
    # transformers 5 in-memory names (`model.`-prefixed)
    ("model.language_model.layers.0.mlp.up_proj.weight", "language_model.layers.0.mlp.up_proj.weight"),
    ("model.vision_tower.vision_model.embeddings.patch_embedding.weight",
     "vision_tower.embeddings.patch_embedding.weight"),
    ("model.vision_tower.embeddings.patch_embedding.weight", "vision_tower.embeddings.patch_embedding.weight"),
    ("model.multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias"),
    ("model.language_model.model.norm.weight", "language_model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


@pytest.fixture(scope="module")
def key_mapper(tiny_ckpt):
    from transformers import AutoConfig

    return transformers_key_mapper(AutoConfig.from_pretrained(tiny_ckpt), "LlavaForConditionalGeneration")


@pytest.mark.parametrize("key,expected", LAYOUT_ROWS)
def test_every_llava_hf_layout_maps_to_one_name(key_mapper, key, expected):
    assert key_mapper(key) == expected


def test_every_mapped_name_is_a_parameter_of_the_model(key_mapper, tiny_ckpt):
    """The hub spelling of every real key maps onto mmkit's own parameter names."""
    from safetensors import safe_open

    llm = get_llm(tiny_ckpt)
    names = set(llm.llm_engine.model_runner.model.state_dict())
    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fused after loading
    for key in keys:
        name = key_mapper(hub_key(key))
        assert name == key_mapper(key)
        assert name in names or any(p in name for p in fused), (key, name)


def test_unexpected_and_missing_weights_name_the_checkpoint_keys(tiny_ckpt, tmp_path):
    extra = resave_checkpoint(tiny_ckpt, tmp_path / "extra",
                    lambda s: s.update({"vision_tower.vision_model.head.probe": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"1 unexpected weights.*vision_tower\.vision_model\.head\.probe"):
        LLM(str(extra), dtype="float32")
    missing = resave_checkpoint(tiny_ckpt, tmp_path / "missing",
                      lambda s: s.pop("language_model.model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*language_model\.layers\.1\.mlp\.down_proj"):
        LLM(str(missing), dtype="float32")


def test_model_id_from_the_local_hf_cache(tiny_ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llava" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_ckpt, snapshot)
    (cache / "models--acme--tiny-llava" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-llava" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    llm = LLM("acme/tiny-llava", dtype="float32")
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt="Hello", max_new_tokens=6)


def test_generated_image_token_is_ordinary_also_after_preemption(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    engine = llm.llm_engine
    image_id = engine.config.model.image_token_id
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Make the model "sample" the image token id as its third token, then force a preemption:
    # the recompute must embed it as a token (no image, no placeholder range), never as an image slot.
    sampler = engine.model_runner.sampler
    calls = {"n": 0}

    def third_is_image_token(logits, rows):
        out = type(sampler).__call__(sampler, logits, rows)
        calls["n"] += 1
        if calls["n"] == 3:
            out.token_ids[0] = image_id
        return out

    monkeypatch.setattr(engine.model_runner, "sampler", third_is_image_token)
    engine.add_request("r", "A prompt without any image", params)
    for _ in range(3):
        engine.step()
    group = engine.groups["r"]
    seq = group.seq
    assert seq.token_ids[-1] == image_id
    engine.scheduler._preempt(seq, type("Out", (), {"num_preempted": 0})())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    generated = outputs[0].outputs[0].token_ids
    assert generated[2] == image_id and engine.get_metrics()["num_preemptions"] >= 1
    prefix = list(group.prompt_token_ids) + generated[:3]
    ref = hf_greedy(tiny_ckpt, input_ids=prefix, max_new_tokens=len(generated) - 3)
    assert generated[3:] == ref
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
