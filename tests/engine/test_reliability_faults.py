"""Faults: KV-cache exhaustion, aborts in every state, injected exceptions, interrupts.

What tests/engine/test_engine.py and tests/engine/test_async_engine.py already show is not repeated here
(preemption of a mixed batch, abort of a running request, one injected model error, an engine
that fails on its first step); this file covers the rest: aborts of preempted, waiting,
chunked-prefill and n > 1 requests with the block accounting checked after every step,
preemption of n > 1 requests, errors and interrupts at several points of a step, and
engine-loop failures in the middle of streaming.
"""

import asyncio
import time
from collections import Counter

import pytest

from conftest import get_llm, make_image, break_pixels_of_width
from mmkit import LLM, AsyncLLMEngine, EngineArgs, EngineDeadError, RequestFailedError, SamplingParams
from mmkit.engine import detokenizer

PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"


def long_params(max_tokens=40, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def batch(n):
    return [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(60 + i)}} if i % 2
            else f"Tell me about the sea, story {i}" for i in range(n)]


def live_block_refs(engine) -> Counter:
    refs: Counter = Counter()
    for group in engine.groups.values():
        if not group.seq.is_finished:
            refs.update(engine.block_manager.get_block_ids(group.seq))
    return refs


def check_blocks(engine) -> None:
    """Free list + referenced blocks partition the cache; ref counts equal live references."""
    bm = engine.block_manager
    refs = live_block_refs(engine)
    for block_id in range(bm.num_blocks):
        assert bm.ref_counts[block_id] == refs[block_id], (block_id, bm.ref_counts[block_id], refs[block_id])
    assert bm.num_free_blocks == bm.num_blocks - len(refs)
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)  # no block freed twice
    assert not set(bm.free_block_ids) & set(refs)


def assert_engine_empty(engine) -> None:
    assert not engine.has_unfinished_requests() and engine.groups == {}
    assert not engine.scheduler.waiting and not engine.scheduler.running
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sum(bm.ref_counts) == 0 and min(bm.ref_counts) == 0


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def drain(engine, check=True) -> dict:
    finished = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check:
            check_blocks(engine)
    pytest.fail("engine did not drain")


def preempted_seqs(engine):
    return [s for s in engine.scheduler.waiting if s.num_output_tokens > 0]


# ---------------------------------------------------------------------- KV cache exhaustion
def test_preemption_with_forked_samples_keeps_outputs(tiny_ckpt):
    """n > 1 requests share prompt blocks; preempting them and recomputing changes nothing."""
    inputs = batch(4)
    params = [long_params(30 + 3 * i, n=2 if i % 2 == 0 else 1, seed=7 + i, temperature=0.8) for i in range(4)]
    roomy = get_llm(tiny_ckpt).generate(inputs, params, use_tqdm=False)
    small = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=12, block_size=8)
    engine = small.llm_engine
    for i, (inp, sp) in enumerate(zip(inputs, params)):
        engine.add_request(f"r{i}", inp, sp)
    outs = drain(engine)
    assert small.get_metrics()["num_preemptions"] > 0
    assert token_ids([outs[f"r{i}"] for i in range(4)]) == token_ids(roomy)
    assert_engine_empty(engine)


def test_preemption_with_chunked_prefill_keeps_outputs(tiny_ckpt):
    inputs = batch(5)
    params = long_params(36)
    roomy = get_llm(tiny_ckpt).generate(inputs, params, use_tqdm=False)
    small = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=10, block_size=8, max_num_batched_tokens=12)
    outs = small.generate(inputs, params, use_tqdm=False)
    m = small.get_metrics()
    assert m["num_preemptions"] > 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
    assert token_ids(outs) == token_ids(roomy)
    assert_engine_empty(small.llm_engine)


# ---------------------------------------------------------------------- aborts free every block
@pytest.fixture()
def small_engine(tiny_ckpt):
    return LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=12, block_size=8, max_num_seqs=4).llm_engine


def test_abort_preempted_running_and_waiting(small_engine, tiny_ckpt):
    engine = small_engine
    inputs, params = batch(7), long_params(45)
    for i, inp in enumerate(inputs):
        engine.add_request(f"r{i}", inp, params)
    for _ in range(300):
        engine.step()
        check_blocks(engine)
        if preempted_seqs(engine):
            break
    victim = preempted_seqs(engine)[0]
    assert engine.block_manager.get_block_ids(victim) == () and victim.num_computed_tokens == 0
    aborted = {victim.group.request_id}
    engine.abort_request(victim.group.request_id)
    check_blocks(engine)
    running = engine.scheduler.running[0]
    assert engine.block_manager.get_block_ids(running)
    aborted.add(running.group.request_id)
    engine.abort_request(running.group.request_id)
    check_blocks(engine)
    never_started = [s for s in engine.scheduler.waiting if s.num_output_tokens == 0]
    assert never_started, "expected a request that never ran (max_num_seqs=4)"
    aborted.add(never_started[-1].group.request_id)
    engine.abort_request([never_started[-1].group.request_id, "no-such-request"])
    check_blocks(engine)
    assert all(rid not in engine.groups for rid in aborted)
    assert victim not in engine.scheduler.waiting and victim.status.value == "abort"
    finished = drain(engine)
    assert set(finished) == {f"r{i}" for i in range(7)} - aborted
    assert_engine_empty(engine)
    reference = get_llm(tiny_ckpt).generate(inputs, params, use_tqdm=False)
    for i, ref in enumerate(reference):
        if f"r{i}" in finished:
            assert finished[f"r{i}"].outputs[0].token_ids == ref.outputs[0].token_ids
    engine.abort_request(list(finished))  # aborting finished requests is a no-op
    assert_engine_empty(engine)


def test_abort_forked_samples_frees_shared_blocks(small_engine):
    engine = small_engine
    engine.add_request("fork", "a prompt whose blocks are shared by 3 samples", long_params(30, n=3, seed=1,
                                                                                           temperature=1.0))
    engine.add_request("other", "another one", long_params(30))
    for _ in range(50):
        engine.step()
        check_blocks(engine)
        children = [engine.groups[f"{i}_fork"] for i in range(3)]  # the n = 3 request's samples
        if all(g.seq.num_output_tokens >= 3 for g in children):
            break
    shared = set(engine.block_manager.get_block_ids(children[0].seq)[:1])
    assert any(engine.block_manager.ref_counts[b] > 1 for b in shared)  # through the prefix cache
    engine.abort_request("fork")
    assert all(g.seq.status.value == "abort" for g in children)
    check_blocks(engine)
    assert drain(engine)["other"].finished
    assert_engine_empty(engine)


def test_abort_forked_before_fork(small_engine):
    """Aborted before any of its n samples ran (prompt not yet computed)."""
    engine = small_engine
    engine.add_request("pending", "not yet prefilled", long_params(10, n=4, seed=3, temperature=1.0))
    engine.abort_request("pending")
    assert_engine_empty(engine)


def test_abort_during_chunked_prefill(tiny_ckpt):
    engine = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=10, block_size=8,
                 max_num_batched_tokens=6).llm_engine
    engine.add_request("img", {"prompt": PROMPT, "multi_modal_data": {"image": make_image(3)}}, long_params(5))
    engine.step()
    engine.step()
    seq = engine.groups["img"].seq
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens and engine.block_manager.get_block_ids(seq)
    engine.abort_request("img")
    assert_engine_empty(engine)
    assert engine.groups == {} and engine.block_manager.get_block_ids(seq) == ()


# ---------------------------------------------------------------------- injected exceptions
@pytest.mark.parametrize("fail_at_call", [1, 4, 25])
def test_model_error_at_any_step_leaves_engine_clean(tiny_ckpt, monkeypatch, fail_at_call):
    """Including after preemptions and forks; the next call gives the reference outputs."""
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=10, block_size=8)
    inputs = batch(5)
    params = [long_params(30, n=2 if i == 0 else 1, seed=5, temperature=0.7 if i == 0 else 0) for i in range(5)]
    runner = llm.llm_engine.model_runner
    original = runner.execute_model
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == fail_at_call:
            raise RuntimeError(f"injected failure at call {fail_at_call}")
        return original(sched)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(RuntimeError, match=f"injected failure at call {fail_at_call}"):
        llm.generate(inputs, params, use_tqdm=False)
    assert_engine_empty(llm.llm_engine)
    monkeypatch.setattr(runner, "execute_model", original)
    again = llm.generate(inputs, params, use_tqdm=False)
    assert token_ids(again) == token_ids(get_llm(tiny_ckpt).generate(inputs, params, use_tqdm=False))


def test_image_processing_error_in_generate(tiny_ckpt, monkeypatch):
    """A failure while preparing one request's pixels ends that request alone: generate
    raises one RequestFailedError carrying the other prompts' normal outputs."""
    llm = LLM(str(tiny_ckpt), dtype="float32")
    break_pixels_of_width(monkeypatch, llm.llm_engine.input_processor, 13)
    bad = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2, width=13)}}
    with pytest.raises(RequestFailedError, match=r"1 of 5 prompts failed: inputs\[4\].*broken image data") as info:
        llm.generate(batch(4) + [bad], long_params(8), use_tqdm=False)
    assert set(info.value.failed) == {4} and isinstance(info.value.failed[4], OSError)
    assert info.value.outputs[4] is None and isinstance(info.value.__cause__, OSError)
    ref = get_llm(tiny_ckpt).generate(batch(4), long_params(8), use_tqdm=False)
    assert token_ids(info.value.outputs[:4]) == token_ids(ref)
    assert_engine_empty(llm.llm_engine)
    assert all(o.finished for o in llm.generate(batch(4), long_params(4), use_tqdm=False))


@pytest.mark.parametrize("where", ["execute_model", "schedule", "detokenize", "pixel_values"])
def test_keyboard_interrupt_mid_generate_leaves_nothing(tiny_ckpt, monkeypatch, where):
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=10, block_size=8)
    engine = llm.llm_engine
    calls = {"n": 0}

    def interrupt_on_fifth(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == (1 if where == "pixel_values" else 5):
                raise KeyboardInterrupt
            return fn(*args, **kwargs)
        return wrapper

    if where == "execute_model":
        monkeypatch.setattr(engine.model_runner, "execute_model", interrupt_on_fifth(engine.model_runner.execute_model))
    elif where == "schedule":
        monkeypatch.setattr(engine.scheduler, "schedule", interrupt_on_fifth(engine.scheduler.schedule))
    elif where == "detokenize":
        monkeypatch.setattr(detokenizer, "decode_incrementally", interrupt_on_fifth(detokenizer.decode_incrementally))
    else:
        monkeypatch.setattr(engine.input_processor, "pixel_values", interrupt_on_fifth(engine.input_processor.pixel_values))
    # NOTE: `generate` decodes text once at finish unless a stop string needs it per token; a
    # stop string that never matches keeps the detokenizer in the decode loop.
    params = long_params(30, stop=["never in this vocabulary"]) if where == "detokenize" else long_params(30)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch(6), params, use_tqdm=False)
    assert calls["n"] >= 1
    assert_engine_empty(engine)
    monkeypatch.undo()
    assert all(o.finished for o in llm.generate(batch(3), long_params(3), use_tqdm=False))


# ---------------------------------------------------------------------- AsyncLLMEngine
@pytest.fixture()
def async_engine(tiny_ckpt):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32",
                                                     num_kv_blocks=12, block_size=8))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("target", ["execute_model", "schedule"])
def test_async_failure_mid_stream_reaches_every_caller(async_engine, target):
    inner = async_engine.engine
    owner = inner.model_runner if target == "execute_model" else inner.scheduler
    original = getattr(owner, target)
    calls = {"n": 0}

    def dies_later(*args):
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("engine blew up")
        return original(*args)

    setattr(owner, target, dies_later)
    seen = Counter()

    async def consume(i):
        async for out in async_engine.generate(batch(8)[i], long_params(200), f"s{i}"):
            seen[i] += 1
        return "finished"

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
        with pytest.raises(EngineDeadError):  # the engine stays dead: an immediate error, no hang
            await asyncio.wait_for(consume(0), timeout=5)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "engine blew up" in str(results[0]) and sum(seen.values()) > 0
    assert async_engine.errored


def test_async_abort_of_preempted_request_frees_blocks(async_engine, tiny_ckpt):
    inner = async_engine.engine
    state = {"aborted": None}

    async def consume(i):
        outs = []
        async for out in async_engine.generate(batch(6)[i], long_params(40), f"a{i}"):
            outs.append(out)
            preempted = preempted_seqs(inner)
            if state["aborted"] is None and preempted:
                state["aborted"] = preempted[0].group.request_id
                await async_engine.abort(state["aborted"])
        return outs

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        deadline = time.monotonic() + 60  # the loop applies the last abort between steps
        while inner.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return results

    results = asyncio.run(main())
    assert state["aborted"] is not None, "no request was preempted"
    assert inner.get_metrics()["num_preemptions"] > 0
    reference = get_llm(tiny_ckpt).generate(batch(6), long_params(40), use_tqdm=False)
    for i, outs in enumerate(results):
        if f"a{i}" == state["aborted"]:
            assert not outs or not outs[-1].finished
        else:
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference[i].outputs[0].token_ids
    assert_engine_empty(inner)
