"""LLMEngine, Scheduler and BlockManager: preemption, aborts, faults, metrics."""

import pytest
import torch

from conftest import get_llm, hf_greedy, make_image
from mmkit import LLM, SamplingParams
from mmkit.engine.llm_engine import LLMEngine

PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"


def mixed_inputs(n=6):
    items = []
    for i in range(n):
        if i % 2:
            items.append({"prompt": PROMPT, "multi_modal_data": {"image": make_image(40 + i)}})
        else:
            items.append("Tell me a long story about the sea number " + str(i))
    return items


def test_preemption_keeps_outputs_and_frees_blocks(tiny_ckpt):
    params = [SamplingParams(temperature=0, max_tokens=30 + 5 * i, ignore_eos=True) for i in range(6)]
    roomy = get_llm(tiny_ckpt).generate(mixed_inputs(), params, use_tqdm=False)
    # 12 blocks of 16 tokens: every request fits alone, six together do not.
    small = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=12, block_size=16)
    outs = small.generate(mixed_inputs(), params, use_tqdm=False)
    metrics = small.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"] == 12
    assert metrics["num_requests_finished"] == 6


def test_chunked_prefill_matches_hf(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=8)
    img = make_image(3)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                       SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt=PROMPT, images=img, max_new_tokens=20)


def test_request_larger_than_cache_or_model_len_is_rejected(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="whole KV cache holds 8 tokens"):
        llm.generate("a prompt that is clearly longer than eight tokens in total", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len = 64"):
        llm.generate({"prompt_token_ids": [5] * 65}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # A cache smaller than max_model_len is fine: the output stops when the cache is full.
    out = llm.generate({"prompt_token_ids": [1, 5]}, SamplingParams(temperature=0, max_tokens=50,
                                                                    ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert llm.get_metrics()["kv_blocks_free"] == 2


def test_engine_api_and_abort(tiny_ckpt):
    engine = get_llm(tiny_ckpt).llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", "first prompt", params)
    engine.add_request("b", {"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "dup", params)
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.add_request("c", "waiting one", params)
    engine.abort_request(["c"])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_legacy_keywords_warn(tiny_ckpt):
    engine = get_llm(tiny_ckpt).llm_engine
    with pytest.warns(DeprecationWarning, match="prompt_token_ids=") as rec:
        engine.add_request("legacy", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))
    assert rec[0].filename == __file__
    while engine.has_unfinished_requests():
        engine.step()


def test_model_error_propagates_and_engine_stays_usable(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    runner = llm.llm_engine.model_runner
    original = runner.execute_model
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(sched)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(mixed_inputs(4), SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    m = llm.get_metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    out = llm.generate("works again", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].finished


def test_keyboard_interrupt_leaves_nothing(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    runner = llm.llm_engine.model_runner
    original = runner.execute_model

    def interrupted(sched):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(mixed_inputs(3), use_tqdm=False)
    monkeypatch.setattr(runner, "execute_model", original)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_metrics_names(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    llm.generate(["a b c", "d e"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    for key in ("num_preemptions", "num_requests_finished", "prompt_tokens", "generation_tokens",
                "prefix_cache_queries", "prefix_cache_hits", "encoder_cache_hits", "encoder_cache_misses",
                "kv_blocks_total", "kv_blocks_free"):
        assert key in m
    assert m["generation_tokens"] == 6 and m["num_requests_finished"] == 2
    assert m["prompt_tokens"] == sum(len(llm.get_tokenizer()(t).input_ids) for t in ("a b c", "d e"))


def test_from_engine_args(tiny_ckpt):
    from mmkit import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", num_kv_blocks=7))
    assert engine.block_manager.num_blocks == 7
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(model=str(tiny_ckpt), dtype="int8").create_engine_config()
