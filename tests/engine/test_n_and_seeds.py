"""Seeded sampling (batch- and order-independent), n > 1 sharing the prompt's KV blocks."""

import pytest

from conftest import get_llm, make_image
from mmkit import LLM, SamplingParams

PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"


def seeded_request():
    return {"prompt": PROMPT, "multi_modal_data": {"image": make_image(21)}}


def others():
    """Eight different requests: text and image prompts, greedy, unseeded and seeded sampling."""
    items, params = [], []
    for i in range(8):
        if i % 2:
            items.append({"prompt": PROMPT, "multi_modal_data": {"image": make_image(60 + i)}})
        else:
            items.append("Tell me a long story about the sea number " + str(i) * (i + 1))
        params.append([SamplingParams(temperature=0, max_tokens=12 + i),
                       SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20),
                       SamplingParams(temperature=1.3, seed=100 + i, max_tokens=30 - i, top_k=50)][i % 3])
    return items, params


SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)


def test_seeded_request_is_independent_of_batch_and_order(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    alone = llm.generate(seeded_request(), SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(seeded_request(), SEEDED, use_tqdm=False)[0].outputs[0].token_ids == alone
    items, params = others()
    # Last in a batch of 8 others.
    outs = llm.generate(items + [seeded_request()], params + [SEEDED], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    # First, with the others reversed.
    outs = llm.generate([seeded_request()] + items[::-1], [SEEDED] + params[::-1], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    # Arriving while the others are already decoding (its prefill lands in a decode batch).
    engine = llm.llm_engine
    for i, (item, p) in enumerate(zip(items, params)):
        engine.add_request(f"other-{i}", item, p)
    for _ in range(3):
        engine.step()
    engine.add_request("seeded", seeded_request(), SEEDED)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["seeded"].outputs[0].token_ids == alone
    # A different seed gives a different sample.
    other_seed = llm.generate(seeded_request(), SEEDED.clone(seed=1235), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_seed_is_reproducible_across_engines(tiny_ckpt):
    a = get_llm(tiny_ckpt).generate("Write a haiku about the sea.", SEEDED.clone(n=3), use_tqdm=False)[0]
    fresh = LLM(str(tiny_ckpt), dtype="float32", seed=99)  # another engine seed: irrelevant when seeded
    b = fresh.generate("Write a haiku about the sea.", SEEDED.clone(n=3), use_tqdm=False)[0]
    samples = [c.token_ids for c in a.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) == 3  # the three samples differ
    assert [c.token_ids for c in b.outputs] == samples
    assert all(len(s) == 24 for s in samples)


def test_unseeded_requests_differ(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(["Write a haiku about the sea."] * 2, p, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_n3_shares_prompt_blocks(tiny_ckpt):
    """n = 3 is three requests (vLLM v1's fan-out) that share the prompt's full blocks through
    the prefix cache: allocated once, ref count 3; each sample owns its partial last block."""
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=32, block_size=16)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 32
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=20, ignore_eos=True)
    engine.add_request("r", {"prompt": PROMPT, "multi_modal_data": {"image": make_image(5)}}, params)
    assert sorted(engine.groups) == ["0_r", "1_r", "2_r"] and engine.get_num_unfinished_requests() == 1
    assert engine.has_unfinished_request("r") and not engine.has_unfinished_request("0")
    engine.step()  # all three admitted in one step; the second and third hit the first's full blocks
    children = [engine.groups[f"{i}_r"] for i in range(3)]
    assert all(g.params.n == 1 and g.seq.num_output_tokens == 1 for g in children)
    num_prompt = len(children[0].prompt_token_ids)
    full = num_prompt // 16
    assert num_prompt % 16 != 0 and full >= 1  # a partial last prompt block
    tables = [bm.get_block_ids(g.seq) for g in children]
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert all(bm.ref_counts[b] == 3 for b in tables[0][:full])
    assert len({t[full] for t in tables}) == 3 and all(bm.ref_counts[t[full]] == 1 for t in tables)
    assert bm.num_free_blocks == 32 - full - 3  # the full blocks allocated once, a partial block each
    assert engine.get_metrics()["prefix_cache_hits"] == 2 * full * 16
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "r"
            final = out
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    assert bm.num_free_blocks == 32 and all(c == 0 for c in bm.ref_counts) and bm.req_to_blocks == {}
    assert engine.groups == {} and engine.get_num_unfinished_requests() == 0
    # The same request through LLM.generate gives the same three samples.
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": make_image(5)}}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]


def test_n2_streams_one_output_per_step_and_aborts_whole(tiny_ckpt):
    """A streaming n > 1 request: one RequestOutput per step holding every sample, `finished`
    only when all are; the request counts once; aborting it ends every child."""
    engine = LLM(str(tiny_ckpt), dtype="float32").llm_engine
    before = engine.get_metrics()
    params = SamplingParams(temperature=1.0, n=2, seed=3, ignore_eos=True)
    engine.add_request("s", "Tell me a story", params.clone(max_tokens=3))
    engine.add_request("t", "Tell me a story", params.clone(max_tokens=30))
    with pytest.raises(ValueError, match=r"request_id: '0_t' is already in use by an unfinished request"):
        engine.add_request("0_t", "x", SamplingParams())
    with pytest.raises(ValueError, match=r"request_id: 't' is already in use by an unfinished request"):
        engine.add_request("t", "x", SamplingParams())
    assert engine.get_request_counts() == (0, 2)
    streamed = []
    for _ in range(3):
        outs = {o.request_id: o for o in engine.step()}
        assert set(outs) == {"s", "t"}
        streamed.append(outs["s"])
    assert [len(o.outputs) for o in streamed] == [2, 2, 2]
    assert [[len(c.token_ids) for c in o.outputs] for o in streamed] == [[1, 1], [2, 2], [3, 3]]
    assert [o.finished for o in streamed] == [False, False, True]
    assert engine.get_request_counts() == (1, 0) and engine.has_unfinished_request("t")
    engine.abort_request("t")
    assert not engine.has_unfinished_requests() and engine.groups == {}
    m = engine.get_metrics()
    assert m["num_requests_finished"] - before["num_requests_finished"] == 1  # "s"; "t" was aborted
    assert m["generation_tokens"] - before["generation_tokens"] == 12  # 3 steps x 2 requests x 2 samples
    assert m["prompt_tokens"] - before["prompt_tokens"] == 2 * len(engine.tokenizer("Tell me a story").input_ids)
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_n3_greedy_samples_equal_the_single_greedy(tiny_ckpt):
    """n > 1 must not corrupt the shared prompt KV: greedy forks all equal the n=1 output."""
    llm = get_llm(tiny_ckpt)
    inp = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(8)}}
    one = llm.generate(inp, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    three = llm.generate(inp, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3
    assert [c.text for c in three.outputs] == [one.outputs[0].text] * 3


@pytest.mark.parametrize("n", [2, 4])
def test_n_with_preemption_frees_everything(tiny_ckpt, n):
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=10, block_size=8)
    params = SamplingParams(temperature=1.0, n=n, seed=3, max_tokens=24, ignore_eos=True)
    roomy = get_llm(tiny_ckpt).generate("Tell me a long story", params, use_tqdm=False)[0]
    out = llm.generate("Tell me a long story", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(n))
    assert all(len(c.token_ids) == 24 for c in out.outputs)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in roomy.outputs]
    m = llm.get_metrics()
    if n == 4:
        assert m["num_preemptions"] > 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"] == 10


def test_n3_finishing_on_the_first_token(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=16, block_size=16)
    out = llm.generate("Tell me a long story", SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=1),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out.outputs)
    assert llm.get_metrics()["kv_blocks_free"] == 16


@pytest.mark.parametrize("seed", [2**60, -(2**62), 0])
def test_any_integer_seed_works(tiny_ckpt, seed):
    p = SamplingParams(temperature=1.0, seed=seed, max_tokens=5, ignore_eos=True, n=2)
    llm = get_llm(tiny_ckpt)
    a = llm.generate("hi", p, use_tqdm=False)[0]
    b = llm.generate("hi", p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
