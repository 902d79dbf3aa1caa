"""Qwen3.5, a hybrid decoder (Gated DeltaNet + gated full attention), on a tiny random checkpoint
built with transformers' own classes and processor: greedy ids equal transformers' (float32) for
a mixed batch (text, one image, two images of different sizes, a timestamped video, token-id
prompts), a several-hundred-token prompt prefilled in small chunks (the state carried from chunk
to chunk), forced preemption (the state rebuilt by recompute), a repeated request with the prefix
cache asked for (refused with a log line), eight concurrent requests of different lengths, n > 1
samples (each its own request and state slot); the per-request state slots all come back; bad
inputs fail before anything is added."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import make_image
from qwen_ref import P_2IMG, P_IMG, P_VID, hf_inputs, hf_qwen
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint

N = 24
IMG1, IMG2, IMG3 = make_image(1, 60, 40), make_image(2, 30, 50), make_image(3, 90, 33)
FRAMES = [make_image(10 + i, 48, 32) for i in range(8)]
ARCHS = ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    return build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param[:8]), seed=1)


def greedy(max_tokens=N, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


_REFS: dict = {}


def hf_greedy(path, prompt=None, images=None, videos=None, input_ids=None, max_new_tokens=N) -> list[int]:
    """transformers' greedy ids, exactly `max_new_tokens` tokens (mmkit runs with ignore_eos)."""
    key = (str(path), prompt, id(images), id(videos), tuple(input_ids or ()), max_new_tokens)
    if key not in _REFS:
        model, _ = hf_qwen(str(path))
        if input_ids is not None:
            inputs = {"input_ids": torch.tensor([input_ids]), "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
        else:
            inputs = hf_inputs(path, prompt, images, videos)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        _REFS[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
    return _REFS[key]


def cases(tokenizer):
    text_ids = tokenizer("Write a haiku about the sea.").input_ids
    img_ids = tokenizer(P_IMG).input_ids  # one <|image_pad|>: mmkit expands it
    return [
        ("Write a haiku about the sea.", dict(prompt="Write a haiku about the sea.")),
        ({"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, dict(prompt=P_IMG, images=[IMG1])),
        ({"prompt": P_2IMG, "multi_modal_data": {"image": [IMG2, IMG3]}}, dict(prompt=P_2IMG, images=[IMG2, IMG3])),
        ({"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}, dict(prompt=P_VID, videos=FRAMES)),
        ({"prompt_token_ids": text_ids}, dict(input_ids=text_ids)),
        ({"prompt_token_ids": img_ids, "multi_modal_data": {"image": IMG1}}, dict(prompt=P_IMG, images=[IMG1])),
    ]


def check_batch(llm, path, selected=None):
    batch = cases(llm.get_tokenizer())
    batch = [batch[i] for i in selected] if selected else batch
    outs = llm.generate([inp for inp, _ in batch], greedy(), use_tqdm=False)
    for out, (_, ref) in zip(outs, batch):
        assert list(out.outputs[0].token_ids) == hf_greedy(path, **ref), ref
    return outs


def assert_slots_returned(llm):
    m = llm.get_metrics()
    assert m["state_slots_free"] == m["state_slots_total"] == llm.llm_engine.config.scheduler.max_num_seqs
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_mixed_batch_equals_transformers(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    spec = llm.llm_engine.config.model.capabilities.state_spec
    assert spec.layer_ids == (0, 2) and spec.recurrent_shape == (4, 16, 16) and spec.conv_width == 3
    # KV blocks only for the full-attention layers; the state layers hold none
    kv = llm.llm_engine.model_runner.kv_caches
    assert [k.numel() > 0 for k, _ in kv] == [False, True, False, True]
    outs = check_batch(llm, ckpt)
    video_ids = hf_inputs(ckpt, P_VID, videos=FRAMES)["input_ids"][0].tolist()
    assert list(outs[3].prompt_token_ids) == video_ids
    m = llm.get_metrics()
    assert m["state_bytes_per_request"] == 2 * (4 * 16 * 16 * 4 + (2 * 2 * 16 + 4 * 16) * 3 * 4)
    assert_slots_returned(llm)


def _long_prompt(tokenizer) -> list[int]:
    words = " ".join(f"item{i} is {'red' if i % 3 else 'blue'}," for i in range(40))
    ids = tokenizer(f"<|im_start|>user\n{words} which is blue?<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert 300 <= len(ids) <= 1000, len(ids)
    return ids


def test_long_prompt_prefilled_in_small_chunks(ckpt):
    # 40-token chunks: never aligned with the rule's 64-token blocks; the state crosses 10+ steps.
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=40)
    ids = _long_prompt(llm.get_tokenizer())
    out = llm.generate([{"prompt_token_ids": ids}, {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}],
                       greedy(), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(ckpt, input_ids=ids)
    assert list(out[1].outputs[0].token_ids) == hf_greedy(ckpt, prompt=P_IMG, images=[IMG1])
    assert_slots_returned(llm)


def test_forced_preemption_rebuilds_the_state(ckpt):
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=12, block_size=16)
    check_batch(llm, ckpt, [0, 1, 2, 4])
    assert llm.get_metrics()["num_preemptions"] >= 1
    assert_slots_returned(llm)


def test_repeated_request_with_prefix_cache_asked_for(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="mmkit.engine.llm_engine"):
        llm = LLM(str(ckpt), dtype="float32", block_size=4, enable_prefix_caching=True)
    assert f"prefix caching is off for {type(llm.llm_engine.model_runner.model).__name__}" in caplog.text
    request = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    first = llm.generate(request, greedy(), use_tqdm=False)[0]
    second = llm.generate(request, greedy(), use_tqdm=False)[0]
    ref = hf_greedy(ckpt, prompt=P_IMG, images=[IMG1])
    assert list(first.outputs[0].token_ids) == ref and list(second.outputs[0].token_ids) == ref
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] == 0 and m["encoder_cache_hits"] >= 1  # the image embedding is still reused


def test_eight_concurrent_requests_of_different_lengths(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_num_seqs=8)
    tok = llm.get_tokenizer()
    prompts = [tok(" ".join(["sea"] * (1 + 7 * i)) + " and sky").input_ids for i in range(8)]
    lengths = [4 + 5 * i for i in range(8)]  # finishing at different steps: slots freed mid-batch
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(max_tokens=n) for n in lengths], use_tqdm=False)
    for p, n, out in zip(prompts, lengths, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, input_ids=p, max_new_tokens=max(lengths))[:n]
    assert_slots_returned(llm)


def test_n_samples_each_have_their_own_state(ckpt):
    """n > 1 is n requests (vLLM v1's fan-out), each with its own state slot: greedy samples all
    equal the n = 1 output and transformers'; seeded samples are reproducible and differ. Two
    slots for three samples: the third waits for a slot."""
    llm = LLM(str(ckpt), dtype="float32", max_num_seqs=2)
    request = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    ref = hf_greedy(ckpt, prompt=P_IMG, images=[IMG1])
    one = llm.generate(request, greedy(), use_tqdm=False)[0]
    two, three = llm.generate([request, request], [greedy(n=2), greedy(n=3)], use_tqdm=False)
    assert list(one.outputs[0].token_ids) == ref
    assert [list(c.token_ids) for c in two.outputs] == [ref] * 2 and [c.index for c in two.outputs] == [0, 1]
    assert [list(c.token_ids) for c in three.outputs] == [ref] * 3 and [c.index for c in three.outputs] == [0, 1, 2]
    sampled = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    a, b = (llm.generate("Write a haiku about the sea.", sampled, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert_slots_returned(llm)


def test_bad_inputs_fail_before_anything_is_added(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    ok = {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}
    bad = [
        ({"prompt": P_2IMG, "multi_modal_data": {"image": [IMG1]}}, greedy(), ValueError, r"inputs\[1\]"),
    ]
    for prompt, params, exc, match in bad:
        with pytest.raises(exc, match=match):
            llm.generate([ok, prompt], [greedy(), params], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        assert_slots_returned(llm)
    out = llm.generate(ok, greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, prompt=P_IMG, images=[IMG1])


def test_multi_token_prediction_weights_are_skipped_like_transformers(ckpt, tmp_path):
    """Released checkpoints carry `mtp.*` tensors that transformers ignores on load; so does mmkit
    (any other unexpected tensor is still an error naming it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "mtp"
    shutil.copytree(ckpt, src)
    state = load_file(src / "model.safetensors")
    state["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    out = LLM(str(src), dtype="float32").generate("Write a haiku about the sea.", greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, prompt="Write a haiku about the sea.")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected weights.*extra\.weight"):
        LLM(str(src), dtype="float32")


def test_state_slots_come_out_of_the_kv_budget(ckpt):
    from mmkit.worker.kv_cache import bytes_per_block

    engine = LLM(str(ckpt), dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=4).llm_engine
    mc = engine.config.model
    state = 4 * mc.capabilities.state_spec.bytes_per_slot(mc.dtype)
    assert engine.block_manager.num_blocks == ((1 << 20) - state) // bytes_per_block(mc, 16)
    with pytest.raises(ValueError, match=r"after the hybrid decoder's 256 per-request state slots .* lower max_num_seqs"):
        LLM(str(ckpt), dtype="float32", kv_cache_memory=256 * mc.capabilities.state_spec.bytes_per_slot(mc.dtype))


def test_a_failed_step_recomputes_the_other_hybrid_sequences(ckpt, monkeypatch):
    """An image that fails at scheduling time fails its request alone; the step is undone, and a
    request that was decoding in it is recomputed from token 0 (its state may have moved)."""
    from mmkit import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(ckpt), dtype="float32", async_preprocess=False))
    stage = engine.input_stage
    original = stage.mm_item_inputs

    def failing(request_id, item):
        if request_id == "bad":
            raise RuntimeError("decoder exploded")
        return original(request_id, item)

    monkeypatch.setattr(stage, "mm_item_inputs", failing)
    engine.add_request("good", "Write a haiku about the sea.", greedy())
    for _ in range(5):
        engine.step()
    engine.add_request("bad", {"prompt": P_IMG, "multi_modal_data": {"image": IMG1}}, greedy())
    final, errors = {}, {}
    while engine.has_unfinished_requests():
        result = engine.step_result()
        errors.update(result.errors)
        final.update((o.request_id, o) for o in result.outputs if o.finished)
    assert list(errors) == ["bad"] and "decoder exploded" in str(errors["bad"])
    assert list(final["good"].outputs[0].token_ids) == hf_greedy(ckpt, prompt="Write a haiku about the sea.")
    m = engine.get_metrics()
    assert m["state_slots_free"] == m["state_slots_total"]
