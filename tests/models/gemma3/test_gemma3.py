"""Gemma 3 (SigLIP tower, pooled projector, sliding + global decoder layers with their own
rotary bases, bidirectional image spans, pan-and-scan) against transformers'
Gemma3ForConditionalGeneration: processor ids and spans, float32 greedy ids for a mixed batch
(also chunked, preempted, prefix-cached, on the torch path, in the 4.x hub layout), a 16-token
window with the image inside and outside it, the bidirectional mask shown to matter, and bad
inputs refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import DEVICES, _hf_model, assert_bf16_matches_hf, make_image, pil_to_tensor
from span_ref import check_prefix_cache_hit, hf_span_inputs
from mmkit import LLM, SamplingParams
from mmkit.layers import cpu_kernels
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.gemma3 import rewrite_gemma3_hub_layout

N = 33
ARCH = "Gemma3ForConditionalGeneration"
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
P1 = TURN.format("<start_of_image>What is in the image?")
P2 = TURN.format("<start_of_image> and <start_of_image>Compare the two.")
TEXT = TURN.format("Write a haiku about the sea.")
PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}  # crops for these tiny images
# 40x30: ratio 1.33 (crops under PAS); 90x30: 3 crops; 30x28: below the 1.2 ratio, never cropped.
IMG1, IMG2, IMG3 = make_image(1, 40, 30), make_image(2, 90, 30), make_image(3, 30, 28)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(ARCH, tmp_path_factory.mktemp("gemma3"), seed=0)


def greedy(max_tokens=N):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def hf_generate(path, inputs) -> list[int]:
    """transformers' greedy generate, exactly N tokens. NOTE: EOS neither stops it nor is
    suppressed (mmkit's ignore_eos; HF's min_new_tokens would mask EOS out of the argmax)."""
    import copy

    model, _ = _hf_model(str(path))
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.max_new_tokens, config.do_sample = [], N, False
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_greedy(path, prompt, images=None, mm_kwargs=None) -> list[int]:
    return hf_generate(path, hf_span_inputs(path, prompt, images, mm_kwargs=mm_kwargs))


def hf_greedy_ids(path, ids, images, mm_kwargs=None, bidirectional=True) -> list[int]:
    """transformers' greedy generate on token ids (the soft tokens already written out), with
    `token_type_ids` marking them as its processor does (none: transformers' causal-only run)."""
    _, processor = _hf_model(str(path))
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if images:
        inputs["pixel_values"] = processor(text=[processor.image_token * len(images)], images=[images],
                                           return_tensors="pt", **(mm_kwargs or {}))["pixel_values"]
    if bidirectional:
        inputs["token_type_ids"] = (inputs["input_ids"] == processor.tokenizer.image_token_id).long()
    return hf_generate(path, inputs)


def _parsed(prompt, images, mm_kwargs=None):
    from mmkit.multimodal.parse import parse_prompt

    item = {"prompt": prompt, "multi_modal_data": {"image": images}}
    if mm_kwargs:
        item["mm_processor_kwargs"] = mm_kwargs
    return parse_prompt(0, item)


def test_processor_ids_and_bidirectional_runs_equal_transformers(ckpt):
    """Ids are Gemma3Processor's (with and without pan-and-scan); the bidirectional ranges are
    the runs of its token_type_ids; each span's rows are the model's."""
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=32)
    proc, model = llm.llm_engine.input_processor, llm.llm_engine.model_runner.model
    sizes = [(40, 30), (90, 30), (30, 28), (20, 70), (200, 120), (3, 5)]
    cases = [(P1, [make_image(i, w, h)], kw) for i, (w, h) in enumerate(sizes) for kw in (None, PAS)]
    cases += [(P2, [IMG2, IMG3], PAS), (P2, [IMG1, IMG2], {**PAS, "pan_and_scan_max_num_crops": 2})]
    for prompt, images, kw in cases:
        processed = proc.process(_parsed(prompt, images, kw))
        ref = hf_span_inputs(ckpt, prompt, images, mm_kwargs=kw)
        assert processed.prompt_token_ids == ref["input_ids"][0].tolist(), ([im.size for im in images], kw)
        types = ref["token_type_ids"][0].tolist()
        marked = [p for lo, n in processed.bidirectional_ranges for p in range(lo, lo + n)]
        assert marked == [p for p, t in enumerate(types) if t == 1]
        assert all(types[lo - 1] == 0 for lo, _ in processed.bidirectional_ranges)  # runs are maximal
        with torch.no_grad():
            rows = model.embed_multimodal([proc.mm_item_inputs(item) for item in processed.images])
        assert [r.shape[0] for r in rows] == [n for _, n in processed.placeholder_ranges]
    views = [proc.mm_item_inputs(it)["pixel_values"].shape[0] for it in proc.process(_parsed(P2, [IMG2, IMG3], PAS)).images]
    assert views == [4, 1]  # pan-and-scan on for the request: the wide image cropped, the square one not
    # Engine-wide options: every request gets them, a request's own override them.
    engine_wide = LLM(str(ckpt), dtype="float32", num_kv_blocks=32, mm_processor_kwargs=PAS).llm_engine.input_processor
    assert engine_wide.process(_parsed(P1, [IMG2])).prompt_token_ids == \
        hf_span_inputs(ckpt, P1, [IMG2], mm_kwargs=PAS)["input_ids"][0].tolist()
    assert engine_wide.process(_parsed(P1, [IMG2], {"do_pan_and_scan": False})).prompt_token_ids == \
        hf_span_inputs(ckpt, P1, [IMG2])["input_ids"][0].tolist()


def test_embedding_scale_is_rounded_to_the_weight_dtype():
    """sqrt(3072) = 55.43 is 55.5 in bf16, as transformers multiplies (scale cast first)."""
    from mmkit.models.gemma3 import ScaledEmbedding

    embed = ScaledEmbedding(4, 3072).to(torch.bfloat16)
    ids = torch.tensor([1, 3])
    assert torch.equal(embed(ids), embed.weight[ids] * torch.tensor(55.5, dtype=torch.bfloat16))
    assert torch.equal(embed.float()(ids), embed.weight[ids] * torch.tensor(3072 ** 0.5, dtype=torch.float32))


def _batch():
    """(inputs, HF reference calls): text, one image, two images of different sizes with
    pan-and-scan (one gets crops), one image with pan-and-scan, a token-id prompt."""
    cases = [(TEXT, None, None), (P1, [IMG1], None), (P2, [IMG2, IMG3], PAS), (P1, [IMG2], PAS)]
    inputs = [TEXT] + [dict({"prompt": p, "multi_modal_data": {"image": ims}}, **({"mm_processor_kwargs": kw}
                                                                                  if kw else {}))
                       for p, ims, kw in cases[1:]]
    return inputs, cases


def _refs(path, cases):
    return [hf_greedy(path, p, ims, kw) for p, ims, kw in cases]


def test_mixed_batch_chunked_preempted_torch_path_equal_transformers(ckpt, monkeypatch):
    llm = LLM(str(ckpt), dtype="float32")
    inputs, cases = _batch()
    refs = _refs(ckpt, cases)
    tokens = {"prompt_token_ids": llm.get_tokenizer()(P1).input_ids, "multi_modal_data": {"image": pil_to_tensor(IMG3)}}
    outs = llm.generate(inputs + [tokens], greedy(), use_tqdm=False)
    assert len(set(refs[2])) > 3  # a lively reference: the comparison can fail
    assert [o.outputs[0].token_ids for o in outs[:-1]] == refs
    # The token-id prompt: one <start_of_image> expanded by mmkit; transformers on those ids.
    assert outs[-1].outputs[0].token_ids == hf_greedy_ids(ckpt, outs[-1].prompt_token_ids, [IMG3])
    expanded = {"prompt_token_ids": outs[3].prompt_token_ids, "multi_modal_data": {"image": IMG2},
                "mm_processor_kwargs": PAS}  # the span already written out
    assert llm.generate(expanded, greedy(), use_tqdm=False)[0].outputs[0].token_ids == refs[3]
    for kwargs in (dict(max_num_batched_tokens=7), dict(num_kv_blocks=40, block_size=8)):
        small = LLM(str(ckpt), dtype="float32", **kwargs)
        assert [o.outputs[0].token_ids for o in small.generate(inputs, greedy(), use_tqdm=False)] == refs, kwargs
        if "num_kv_blocks" in kwargs:
            assert small.get_metrics()["num_preemptions"] > 0
    monkeypatch.setitem(cpu_kernels._state, "lib", None)  # every op on torch (no C kernels)
    torch_llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=9)
    assert [o.outputs[0].token_ids for o in torch_llm.generate(inputs, greedy(), use_tqdm=False)] == refs


def test_prefix_cache_hit_reuses_the_image(ckpt):
    check_prefix_cache_hit(ckpt, P1, IMG2, greedy())


def test_bidirectional_spans_matter_and_equal_transformers(ckpt, monkeypatch):
    """With the soft-token ranges dropped (a causal-only run of the same checkpoint) the ids
    change and equal transformers' causal run; with them they equal transformers' own."""
    import mmkit.processors.gemma3 as gemma3_processor

    inputs = [{"prompt": P1, "multi_modal_data": {"image": IMG1}},
              {"prompt": P2, "multi_modal_data": {"image": [IMG2, IMG3]}, "mm_processor_kwargs": PAS}]
    cases = [(P1, [IMG1], None), (P2, [IMG2, IMG3], PAS)]
    llm = LLM(str(ckpt), dtype="float32")
    both = [o.outputs[0] for o in llm.generate(inputs, greedy(), use_tqdm=False)]
    assert [o.token_ids for o in both] == _refs(ckpt, cases)
    monkeypatch.setattr(gemma3_processor, "soft_token_runs", lambda *args: [])
    causal_llm = LLM(str(ckpt), dtype="float32")
    outs = causal_llm.generate(inputs, greedy(), use_tqdm=False)
    causal = [o.outputs[0].token_ids for o in outs]
    assert all(c != b.token_ids for c, b in zip(causal, both))
    assert causal == [hf_greedy_ids(ckpt, o.prompt_token_ids, ims, kw, bidirectional=False)
                      for o, (_, ims, kw) in zip(outs, cases)]


def test_hub_layout_tied_softcapped_gives_the_same_ids(tmp_path):
    """Released checkpoints tie the LM head; the 4.x layout holds `language_model.model.*`,
    bf16 shards, rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern.
    A final logit cap keeps transformers' greedy ids (tanh is monotonic) and bounds the logits."""
    import json

    src = build_tiny_checkpoint(ARCH, tmp_path / "tied", seed=3, init_std=0.02, tie_word_embeddings=True,
                                final_logit_softcapping=2.0)
    hub = rewrite_gemma3_hub_layout(src, tmp_path / "hub")
    text = json.loads((hub / "config.json").read_text())["text_config"]
    assert "layer_types" not in text and text["sliding_window_pattern"] == 2
    assert text["rope_scaling"] == {"factor": 2.0, "rope_type": "linear"} and text["rope_local_base_freq"] == 1e4
    keys = json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("language_model.model.layers.") for k in keys) and "lm_head.weight" not in keys
    llm = LLM(str(hub), dtype="float32")
    inputs, cases = _batch()
    assert [o.outputs[0].token_ids for o in llm.generate(inputs, greedy(), use_tqdm=False)] == _refs(hub, cases)
    model = llm.llm_engine.model_runner.model
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
    with torch.no_grad():
        logits = model.compute_logits(torch.randn(4, 64) * 50)
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9


def test_sliding_window_16_image_inside_and_outside(tmp_path, monkeypatch):
    """Sliding layers with a 16-token window next to a global one, prompts far longer than the
    window: the image at the start (outside every later query's window) and near the end
    (inside it); also chunked, preempted, after a prefix-cache hit, and on the torch path."""
    path = build_tiny_checkpoint(ARCH, tmp_path / "sliding", seed=5, sliding_window=16)
    filler = " the quick brown fox jumps over the lazy dog" * 3
    early = TURN.format(f"<start_of_image>{filler} What is in the image?")
    late = TURN.format(f"{filler} Now look: <start_of_image>What is it?")
    cases = [(early, [IMG2], None), (late, [IMG1], None), (TURN.format(f"<start_of_image>{filler}<start_of_image>"),
                                                           [IMG3, IMG2], PAS)]
    refs = _refs(path, cases)
    inputs = [dict({"prompt": p, "multi_modal_data": {"image": ims}}, **({"mm_processor_kwargs": kw} if kw else {}))
              for p, ims, kw in cases]
    for kwargs in ({}, {"max_num_batched_tokens": 8}, "preempt"):
        if kwargs == "preempt":  # room for the longest request alone: the others are preempted
            kwargs = {"num_kv_blocks": max(-(-(len(o.prompt_token_ids) + N) // 8) for o in outs) + 1, "block_size": 8}
        llm = LLM(str(path), dtype="float32", **kwargs)
        outs = llm.generate(inputs, greedy(), use_tqdm=False)
        assert llm.llm_engine.config.model.capabilities.layer_sliding_windows == (16, None, 16)
        assert all(len(o.prompt_token_ids) > 64 for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == refs, kwargs
        if "num_kv_blocks" in kwargs:
            assert llm.get_metrics()["num_preemptions"] > 0
    # A second question after the image and the filler: the cache hit ends far past the window.
    check_prefix_cache_hit(path, early, IMG2, greedy())
    monkeypatch.setitem(cpu_kernels._state, "lib", None)
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert [o.outputs[0].token_ids for o in llm.generate(inputs, greedy(), use_tqdm=False)] == refs


def test_bad_inputs_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32", limit_mm_per_prompt={"image": 2})
    ok = {"prompt": P1, "multi_modal_data": {"image": IMG1}}
    three = TURN.format("<start_of_image>" * 3)
    bad = [
        ({**ok, "mm_processor_kwargs": {"do_image_splitting": True}},
         r"inputs\[1\]\.mm_processor_kwargs: unknown key\(s\) \['do_image_splitting'\]; expected only "
         r"\['do_pan_and_scan', 'pan_and_scan_min_crop_size'"),
        ({**ok, "mm_processor_kwargs": {"pan_and_scan_max_num_crops": 0}},
         r"inputs\[1\]\.mm_processor_kwargs\['pan_and_scan_max_num_crops'\]: got 0; expected a positive integer"),
        ({"prompt": three, "multi_modal_data": {"image": [IMG1, IMG2, IMG3]}},
         r"inputs\[1\]\.multi_modal_data: got 3 images; expected at most limit_mm_per_prompt\['image'\] = 2"),
        ({"prompt": P1, "multi_modal_data": {"image": [IMG1, IMG2]}},
         r"inputs\[1\]: the prompt has 1 <start_of_image> placeholder\(s\) for 2 image\(s\)"),
        ({"prompt": P1}, r"inputs\[1\]: the prompt has 1 <start_of_image> placeholder\(s\) for 0 image\(s\)"),
        ({"prompt": P1, "multi_modal_data": {"video": [IMG1, IMG1]}},
         r"inputs\[1\]\.multi_modal_data: got a 'video'; Gemma3ForConditionalGeneration takes images only"),
        ({"prompt": P1, "multi_modal_data": {"image_embeds": torch.zeros(1, 15, 64)}},
         r"inputs\[1\]\.multi_modal_data\['image_embeds'\]: got shape \(1, 15, 64\); expected \[1, \d+, \d+\]"),
    ]
    for item, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([ok, item], greedy(4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.input_processor.supported_modalities == ("image",)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs: unknown key\(s\) \['size'\]"):
        LLM(str(ckpt), dtype="float32", mm_processor_kwargs={"size": {"height": 64}})


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_agrees_with_transformers_bf16(ckpt, device):
    """Whole sequences against transformers' own bf16 generate (the bf16 C kernels on CPU): equal,
    or first different at a bf16 tie of transformers' own logits (conftest.assert_bf16_matches_hf)."""
    inputs = [TEXT, {"prompt": P1, "multi_modal_data": {"image": IMG2}}]
    refs = [dict(prompt=TEXT), dict(prompt=P1, images=[IMG2])]
    num_equal = assert_bf16_matches_hf(ckpt, device, inputs, refs)
    print(f"bf16 sequences equal to transformers' gemma3 {device}: {num_equal} of {len(refs)}")


def test_chat_renders_the_checkpoint_template(ckpt):
    """LLM.chat with an image part: the checkpoint's template puts `<start_of_image>` there and
    the result is transformers' for the rendered prompt."""
    llm = LLM(str(ckpt), dtype="float32")
    msg = [{"role": "user", "content": [{"type": "image", "image": IMG2}, {"type": "text", "text": "What is shown?"}]}]
    out = llm.chat(msg, greedy(), use_tqdm=False)[0]
    assert out.prompt.count("<start_of_image>") == 1 and out.prompt.endswith("<start_of_turn>model\n")
    assert out.prompt_token_ids == hf_span_inputs(ckpt, out.prompt, [IMG2])["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_greedy(ckpt, out.prompt, [IMG2])


def test_unsupported_configs_are_refused_by_name():
    import transformers

    from mmkit.models.registry import ModelRegistry

    def config(**text):
        cfg = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text))
        cfg.architectures = [ARCH]
        return cfg

    ModelRegistry.architecture_of(config())
    with pytest.raises(ValueError, match="use_bidirectional_attention=True .* is not supported"):
        ModelRegistry.architecture_of(config(use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        ModelRegistry.architecture_of(config(attn_logit_softcapping=50.0))
    # As a config.json holds it (transformers 5.17 refuses a LlamaConfig object there).
    llama = transformers.Gemma3Config(text_config={"model_type": "llama"})
    llama.architectures = [ARCH]
    with pytest.raises(ValueError, match=r"with a 'llama' language model is not supported; supported language "
                                         r"models: \['gemma3_text'\]"):
        ModelRegistry.architecture_of(llama)


def test_generic_code_names_no_gemma():
    """Gemma 3 plugs in through models/ and processors/ alone: the engine, the worker, the
    input stage, the config and the LLM never name it or its tokens."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "mmkit"
    files = [*(root / "engine").rglob("*.py"), *(root / "worker").rglob("*.py"), *(root / "multimodal").rglob("*.py"),
             root / "config.py", root / "entrypoints" / "llm.py"]
    pattern = re.compile(r"gemma|siglip|start_of_image|soft_token|pan_and_scan", re.IGNORECASE)
    named = [f"{f.relative_to(root)}:{i + 1}" for f in files
             for i, line in enumerate(f.read_text().splitlines()) if pattern.search(line)]
    assert len(files) > 10 and named == []


def test_released_4x_config_is_read_as_transformers_reads_it(tmp_path):
    """google/gemma-3-4b-it's config.json (4.x keys: rope_scaling of the global layers,
    rope_theta, rope_local_base_freq, sliding_window_pattern): every sixth layer global, the
    others a 1024-token window; each layer's rotary table is transformers' for its layer type."""
    import json

    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from mmkit.models.gemma3 import Gemma3ForConditionalGeneration
    from mmkit.models.meta_init import meta_parameters

    text = {"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 2560, "intermediate_size": 10240,
            "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
            "query_pre_attn_scalar": 256, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 1024,
            "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [ARCH], "model_type": "gemma3", "text_config": text, "vision_config": vision,
        "mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000,
        "image_token_index": 262144, "transformers_version": "4.50.0.dev0"}))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with meta_parameters():  # no weights allocated
        model = Gemma3ForConditionalGeneration(config, max_positions=64)
    layers = model.language_model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [None if (i + 1) % 6 == 0 else 1024
                                                                     for i in range(34)]
    assert layers[0].self_attn.scale == 256 ** -0.5 and model.final_logit_softcapping is None
    hf = Gemma3RotaryEmbedding(config.text_config)
    positions = torch.arange(64)[None]
    for kind, rotary in model.language_model.rotary.items():
        cos, sin = hf(torch.zeros(1), positions, kind)
        assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.signed_sin[:, 128:], sin[0, :, 128:])
    local, glob = model.language_model.rotary["sliding_attention"], model.language_model.rotary["full_attention"]
    inv = 1.0 / (10000.0 ** (torch.arange(0, 256, 2, dtype=torch.float) / 256))
    assert torch.allclose(local.cos[5, :128], torch.cos(5 * inv))
    inv_global = 1.0 / (1e6 ** (torch.arange(0, 256, 2, dtype=torch.float) / 256)) / 8.0
    assert torch.allclose(glob.cos[40, :128], torch.cos(40 * inv_global))
