"""Tied word embeddings decided as transformers decides them (the composite config's flag, not
its text_config's; both tensors present and different: not tied), and no checkpoint tensor
dropped silently: greedy ids (text and image) equal transformers' `generate` on checkpoints
transformers saved with the two flags set differently at the two config levels."""

from __future__ import annotations

import itertools
import json
import shutil
import warnings

import pytest
import torch

from conftest import make_image, resave_checkpoint
from mmkit import LLM, SamplingParams
from mmkit.models.registry import ModelRegistry, ties_word_embeddings
from mmkit.testing import build_tiny_checkpoint

NUM_TOKENS = 12
BUILTIN = {  # model_type -> architecture: every family mmkit registers
    "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}


def test_every_family_is_covered():
    assert set(BUILTIN.values()) <= set(ModelRegistry.get_supported_archs())


@pytest.mark.parametrize("model_type", list(BUILTIN))
def test_tie_rule_is_transformers_own(model_type):
    """For each flag at each level (absent, false, true), mmkit's rule equals what transformers'
    own `tie_weights` mapping of the class says (a meta-device skeleton: nothing allocated)."""
    import transformers

    base = transformers.AutoConfig.for_model(model_type).to_dict()
    config_cls = type(transformers.AutoConfig.for_model(model_type))
    hf_cls = getattr(transformers, BUILTIN[model_type])
    for top, text in itertools.product([None, False, True], repeat=2):
        saved = json.loads(json.dumps(base))
        saved["text_config"]["pad_token_id"] = None  # default vocab sizes vary; irrelevant here
        for level, flag in ((saved, top), (saved["text_config"], text)):
            level.pop("tie_word_embeddings", None)
            if flag is not None:
                level["tie_word_embeddings"] = flag
        config = config_cls.from_dict(saved)
        with torch.device("meta"):
            skeleton = hf_cls(config)
        expected = "lm_head.weight" in skeleton.get_expanded_tied_weights_keys(all_submodels=True)
        assert ties_word_embeddings(config) == expected, (top, text)


def _copy_processor_files(src, dst) -> None:
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and not (dst / extra.name).exists():
            shutil.copy(extra, dst / extra.name)


def _resave_with_text_tie(src, dst):
    """`src` loaded by transformers and saved again with text_config.tie_word_embeddings=True
    while the composite config keeps False (what a default Qwen3-VL-MoE / Gemma 3 text config
    gives): transformers saves the LM head, and does not tie it."""
    import transformers

    arch = json.loads((src / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(src, dtype=torch.float32)
    model.config.text_config.tie_word_embeddings = True
    model.save_pretrained(dst)
    _copy_processor_files(src, dst)
    saved = json.loads((dst / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False and saved["text_config"]["tie_word_embeddings"] is True
    return dst


def _messages(with_image: bool) -> list[dict]:
    content = [{"type": "text", "text": "What is in the image?"}]
    if with_image:
        content.insert(0, {"type": "image", "image": make_image(7, 56, 44)})
    return [{"role": "user", "content": content}]


def _hf_run(path, messages) -> tuple[list[int], list[int], bool]:
    """(prompt ids, greedy ids, whether transformers tied the head) of transformers' own load."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = AutoProcessor.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    model.generation_config.eos_token_id = None  # as mmkit's ignore_eos: EOS is an ordinary token
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist(), tied


def _check_equals_transformers(path) -> LLM:
    llm = LLM(str(path), dtype="float32", seed=0)
    model = llm.llm_engine.model_runner.model
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for with_image in (False, True):
        messages = _messages(with_image)
        out = llm.chat(messages, params, use_tqdm=False)[0]
        prompt_ids, ref, hf_tied = _hf_run(path, messages)
        assert list(out.prompt_token_ids) == prompt_ids
        assert list(out.outputs[0].token_ids) == ref, with_image
        assert (model.lm_head.weight is model.language_model.embed_tokens.weight) == hf_tied
    return llm


@pytest.mark.parametrize("arch", ["Qwen3VLMoeForConditionalGeneration", "Gemma3ForConditionalGeneration"])
def test_text_config_tie_alone_does_not_tie(tmp_path, arch):
    src = build_tiny_checkpoint(arch, tmp_path / "base", seed=2)
    path = _resave_with_text_tie(src, tmp_path / "text_tied")
    llm = _check_equals_transformers(path)
    model = llm.llm_engine.model_runner.model
    assert model.lm_head.weight is not model.language_model.embed_tokens.weight


def test_tied_config_with_a_different_head_in_the_checkpoint_is_not_tied(tmp_path):
    """The config asks for tying but the checkpoint holds its own, different LM head:
    transformers warns and keeps both; so does mmkit (the head is never dropped)."""
    src = build_tiny_checkpoint("LlavaForConditionalGeneration", tmp_path / "base", seed=3)
    path = tmp_path / "tied_flag"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="different values: not tied"):
        _check_equals_transformers(path)


def test_head_only_checkpoint_of_a_tied_config(tmp_path):
    """Tied config, the checkpoint holds the LM head but no token embedding: transformers ties
    the other way round (the embedding takes the head's tensor); so does mmkit."""
    src = build_tiny_checkpoint("LlavaForConditionalGeneration", tmp_path / "base", seed=4,
                                tie_word_embeddings=True)

    def embed_as_head(state):
        (key,) = [k for k in state if k.endswith("embed_tokens.weight")]
        state["lm_head.weight"] = state.pop(key)

    path = resave_checkpoint(src, tmp_path / "head_only", embed_as_head)
    _check_equals_transformers(path)


def test_an_unused_checkpoint_tensor_is_an_error_naming_it(tmp_path):
    src = build_tiny_checkpoint("LlavaForConditionalGeneration", tmp_path / "base", seed=5)
    extra = "model.language_model.layers.0.mlp.extra_proj.weight"

    def add_extra(state):
        state[extra] = torch.zeros(4, 4)

    path = resave_checkpoint(src, tmp_path / "extra", add_extra)
    with pytest.raises(ValueError, match="does not use") as info:
        LLM(str(path), dtype="float32")
    assert extra in str(info.value)


def test_buffers_transformers_ignores_are_a_warning_listing_them(tmp_path):
    src = build_tiny_checkpoint("LlavaForConditionalGeneration", tmp_path / "base", seed=6)
    buffer = "model.language_model.layers.0.self_attn.rotary_emb.inv_freq"

    def add_buffer(state):
        state[buffer] = torch.ones(4)

    path = resave_checkpoint(src, tmp_path / "inv_freq", add_buffer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLM(str(path), dtype="float32")
    assert any(buffer in str(w.message) for w in caught), [str(w.message) for w in caught]
