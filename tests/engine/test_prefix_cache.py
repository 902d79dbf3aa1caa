"""Prefix caching keyed by token ids and image content, and the vision-embedding cache."""

from collections import Counter

import pytest

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.multimodal.parse import parse_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12)
QUESTIONS = ["What is in the image?", "How many shapes are there?", "What color is the circle?",
             "Is there a triangle?", "Describe the image."]


def vqa(image_seed, question):
    return {"prompt": f"USER: <image>\n{question} ASSISTANT:", "multi_modal_data": {"image": make_image(image_seed)}}


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cached(tiny_ckpt):
    return LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=True, block_size=4)


@pytest.fixture(scope="module")
def uncached(tiny_ckpt):
    return LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False, encoder_cache_memory=0, block_size=4)


def test_outputs_identical_on_and_off(cached, uncached):
    shared = "A long shared system preamble that many prompts start with, then: "
    batches = [
        [shared + q for q in QUESTIONS],  # text prompts
        [vqa(i % 2, q) for i, q in enumerate(QUESTIONS)],  # image prompts
        [shared + "hi", vqa(3, "What is in the image?"), {"prompt_token_ids": [1, 5, 6, 7, 8, 9]},
         vqa(3, "Describe the image.")],  # a mix
    ]
    for batch in batches:
        ref = token_ids(uncached.generate(batch, GREEDY, use_tqdm=False))
        first = token_ids(cached.generate(batch, GREEDY, use_tqdm=False))
        second = token_ids(cached.generate(batch, GREEDY, use_tqdm=False))  # served from the caches
        assert first == ref and second == ref
    m = cached.get_metrics()
    assert m["prefix_cache_hits"] > 0
    assert uncached.get_metrics()["prefix_cache_hits"] == 0


def test_same_text_different_images_share_only_the_text_before_the_image(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", block_size=4)
    prompt = "USER: a preamble long enough to fill a few blocks <image>\nWhat is it? ASSISTANT:"
    first = {"prompt": prompt, "multi_modal_data": {"image": make_image(1)}}
    other = {"prompt": prompt, "multi_modal_data": {"image": make_image(2)}}
    llm.generate(first, GREEDY, use_tqdm=False)
    ids = llm.llm_engine.input_processor.process(parse_prompt(0, other)).prompt_token_ids
    image_id = llm.llm_engine.config.model.image_token_id
    text_before = ids.index(image_id)
    before = llm.get_metrics()["prefix_cache_hits"]
    out_other = llm.generate(other, GREEDY, use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hits"] - before
    assert hits == (text_before // 4) * 4  # full blocks of text only, never an image block
    ref = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False).generate(other, GREEDY, use_tqdm=False)
    assert token_ids(out_other) == token_ids(ref)
    # The same image again: everything but the last token is a hit.
    before = llm.get_metrics()["prefix_cache_hits"]
    llm.generate(other, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] - before == ((len(ids) - 1) // 4) * 4


def test_vqa_workload_encodes_each_image_once(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32")
    runner = llm.llm_engine.model_runner
    batch = [vqa(img, q) for img in range(20) for q in (QUESTIONS * 2)[:10]]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert runner.num_vision_calls == 20  # once per distinct image
    m = llm.get_metrics()
    # Requests whose image blocks all come from the prefix cache skip the encoder entirely.
    assert m["encoder_cache_misses"] == 20 and m["encoder_cache_hits"] <= 180
    assert m["prefix_cache_hits"] > 0.5 * m["prefix_cache_queries"]
    ref = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False, encoder_cache_memory=0)
    assert token_ids(outs[:30]) == token_ids(ref.generate(batch[:30], GREEDY, use_tqdm=False))


def test_identical_images_in_one_batch_encoded_once(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False)
    img = make_image(9)
    same = [{"prompt": f"USER: <image>\n{q} ASSISTANT:", "multi_modal_data": {"image": img.copy()}} for q in QUESTIONS]
    llm.generate(same, GREEDY, use_tqdm=False)
    assert llm.llm_engine.model_runner.num_vision_calls == 1


def test_encoder_cache_is_bounded(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", encoder_cache_memory=3 * 16 * 64 * 4)  # three images
    llm.generate([vqa(i, "What is in the image?") for i in range(6)], GREEDY, use_tqdm=False)
    cache = llm.llm_engine.model_runner.encoder_cache
    assert len(cache) == 3 and cache.num_bytes <= cache.budget_bytes


def _check_block_invariants(engine):
    bm = engine.block_manager
    refs = Counter()
    for group in engine.groups.values():
        refs.update(bm.get_block_ids(group.seq))
    for block_id in range(bm.num_blocks):
        assert bm.ref_counts[block_id] == refs[block_id]
        assert (block_id in bm.free_block_ids) == (refs[block_id] == 0)
    for block_hash, block_id in bm.cached.items():
        assert bm.block_hash[block_id] == block_hash


def test_tiny_cache_eviction_keeps_outputs_correct(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", block_size=4, num_kv_blocks=24)
    engine = llm.llm_engine
    batch = [vqa(i % 4, q) for i in range(8) for q in QUESTIONS[:3]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, item in enumerate(batch):
        engine.add_request(f"r{i}", item, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        _check_block_invariants(engine)
    m = llm.get_metrics()
    assert m["kv_blocks_free"] == 24 and m["prefix_cache_hits"] > 0
    ref = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False)
    expected = token_ids(ref.generate(batch, params, use_tqdm=False))
    assert [results[f"r{i}"] for i in range(len(batch))] == expected


def test_failed_step_publishes_no_uncomputed_blocks(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32", block_size=4)
    runner = llm.llm_engine.model_runner

    def broken(sched):
        raise RuntimeError("injected")

    batch = [vqa(5, q) for q in QUESTIONS]
    with monkeypatch.context() as m:
        m.setattr(runner, "execute_model", broken)
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(batch, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.block_manager.cached
    ref = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False)
    assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False)) == token_ids(ref.generate(batch, GREEDY, use_tqdm=False))
