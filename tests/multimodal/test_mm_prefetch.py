"""Overlapped preprocessing (mmkit/multimodal/prefetcher.py): identical outputs with and
without it, a bounded lookahead, and a worker failure that ends only its own request."""

import threading
import time

import pytest

from conftest import get_llm, hf_greedy, make_image
from mmkit import LLM, EngineArgs, RequestFailedError, SamplingParams

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
TWO = "USER: <image> and <image>\nCompare them. ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def wait_for(condition, timeout=60.0):
    """Poll `condition` until it holds; fail after `timeout` seconds (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def inputs(n):
    out = []
    for i in range(n):
        if i % 3 == 2:  # some prompts carry two images
            out.append({"prompt": TWO, "multi_modal_data": {"image": [make_image(100 + i), make_image(200 + i, 33, 50)]}})
        else:
            out.append({"prompt": PROMPT, "multi_modal_data": {"image": make_image(100 + i, 64, 48)}})
    return out


def test_outputs_identical_with_and_without_async_preprocess(tiny_ckpt):
    batch = inputs(7)
    on = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=64, preprocess_lookahead=3)
    off = get_llm(tiny_ckpt, async_preprocess=False)
    assert off.llm_engine.prefetcher is None
    got_on = token_ids(on.generate(batch, GREEDY, use_tqdm=False))
    assert got_on == token_ids(off.generate(batch, GREEDY, use_tqdm=False))
    prefetcher = on.llm_engine.prefetcher
    assert prefetcher.num_prefetched > 0  # the images really came from the workers
    assert prefetcher.num_in_flight == 0 and not prefetcher._live  # nothing left behind
    # And against transformers (float32 greedy) for one request.
    ref = hf_greedy(str(tiny_ckpt), PROMPT, [make_image(100, 64, 48)], max_new_tokens=5, ignore_eos=True)
    assert list(got_on[0]) == list(ref)


def test_lookahead_bounds_the_work_done_ahead(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=64, preprocess_lookahead=2)
    engine = llm.llm_engine
    processor = engine.input_processor
    original = processor.mm_item_inputs
    lock = threading.Lock()
    state = {"calls": 0, "in_workers": 0}

    def counting(item):
        with lock:
            state["calls"] += 1
            state["in_workers"] += threading.current_thread().name.startswith("mmkit-preprocess")
        return original(item)

    processor.mm_item_inputs = counting
    for i, inp in enumerate(inputs(6)):
        engine.add_request(f"r{i}", inp, GREEDY)
    # Let the workers finish what they were given: r0's and r1's images (one each).
    wait_for(lambda: engine.prefetcher.is_ready("r0") and engine.prefetcher.is_ready("r1"))
    assert state["calls"] == 2  # 8 images queued, only `lookahead` processed ahead
    assert engine.prefetcher.num_in_flight == 2
    max_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        max_seen = max(max_seen, engine.prefetcher.num_in_flight)
    assert max_seen <= 2
    assert state["calls"] == 8 and state["in_workers"] >= 2
    assert engine.prefetcher.num_in_flight == 0 and not engine.prefetcher._live


def test_lazily_opened_files_decode_and_hash_in_the_workers(tiny_ckpt, tmp_path):
    """`Image.open(path)` images (decoded on first access): the decode and the content hash
    happen in a prefetch worker, not on the engine thread; the same lazily opened object in
    many requests at once is decoded once, safely; outputs equal the preloaded images'."""
    from PIL import Image

    from mmkit.multimodal.items import ImageItem

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"photo{i}.jpg")
        make_image(300 + i, 96, 72).save(paths[-1], quality=90)
    shared = Image.open(paths[0])  # one lazily opened object in six requests
    lazy = [{"prompt": PROMPT, "multi_modal_data": {"image": shared if i < 6 else Image.open(paths[i % 4])}}
            for i in range(10)]
    loaded = [{"prompt": PROMPT, "multi_modal_data": {"image": Image.open(paths[0] if i < 6 else paths[i % 4])
                                                      .convert("RGB")}} for i in range(10)]
    hashed_on = []
    original = ImageItem._compute_hash

    def recording(item):
        hashed_on.append(threading.current_thread().name)
        return original(item)

    llm = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=16)
    ImageItem._compute_hash = recording
    try:
        got = token_ids(llm.generate(lazy, GREEDY, use_tqdm=False))
    finally:
        ImageItem._compute_hash = original
    # Each item hashed exactly once, the workers taking their share (the engine thread hashes
    # a request it admits alone before a worker reached it).
    assert len(hashed_on) == 10 and any(name.startswith("mmkit-preprocess") for name in hashed_on), hashed_on
    assert got == token_ids(get_llm(tiny_ckpt, async_preprocess=False).generate(loaded, GREEDY, use_tqdm=False))


def test_request_waits_for_its_images_while_others_run(tiny_ckpt):
    """A request whose image a worker is still preparing is not admitted while the step has
    other work: the running request decodes on; admitted once ready; outputs unchanged."""
    llm = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=4)
    engine = llm.llm_engine
    processor = engine.input_processor
    original = processor.mm_item_inputs
    release = threading.Event()

    def slow(item):
        if item.width == 77:  # request "b"'s image only
            assert release.wait(30)
        return original(item)

    processor.mm_item_inputs = slow
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(1, 64, 48)}}
    b = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2, 77, 50)}}
    engine.add_request("a", a, params)
    engine.step()  # a's prefill (alone: admitted even if its worker had not finished)
    engine.add_request("b", b, params)
    for _ in range(3):
        engine.step()
        assert [s.group.request_id for s in engine.scheduler.waiting] == ["b"]  # a decodes, b waits
    assert not engine.prefetcher.is_ready("b")
    release.set()
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    ref = get_llm(tiny_ckpt, async_preprocess=False).generate([a, b], params, use_tqdm=False)
    assert [list(outs["a"]), list(outs["b"])] == [list(o.outputs[0].token_ids) for o in ref]


def test_image_that_fails_in_a_worker_fails_only_its_request(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=64)
    processor = llm.llm_engine.input_processor
    original = processor.mm_item_inputs
    bad = make_image(7, 41, 31)
    threads = []

    def fragile(item):
        if item.source is bad:
            threads.append(threading.current_thread().name)
            raise OSError("worker could not resize the image")
        return original(item)

    processor.mm_item_inputs = fragile
    batch = inputs(4)
    batch.insert(1, {"prompt": PROMPT, "multi_modal_data": {"image": bad}})
    with pytest.raises(RequestFailedError, match=r"1 of 5 prompts failed: inputs\[1\].*could not resize") as info:
        llm.generate(batch, GREEDY, use_tqdm=False)
    assert threads and threads[0].startswith("mmkit-preprocess")  # it failed in a worker
    err = info.value
    assert list(err.failed) == [1] and isinstance(err.failed[1], OSError) and err.outputs[1] is None
    good = [batch[i] for i in (0, 2, 3, 4)]
    ref = get_llm(tiny_ckpt, async_preprocess=False).generate(good, GREEDY, use_tqdm=False)
    assert token_ids([err.outputs[i] for i in (0, 2, 3, 4)]) == token_ids(ref)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.prefetcher._live
    assert engine.prefetcher.num_in_flight == 0
    assert token_ids(llm.generate(good[:2], GREEDY, use_tqdm=False)) == token_ids(ref[:2])  # still usable


@pytest.mark.parametrize("kwargs, error, match", [
    ({"preprocess_lookahead": 0}, ValueError, r"preprocess_lookahead: got 0; expected a positive integer"),
    ({"async_preprocess": "yes"}, TypeError, r"async_preprocess: got str; expected bool"),
])
def test_bad_preprocess_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineArgs(model=None, **kwargs).create_engine_config()


def test_workers_run_torch_on_one_openmp_thread(tiny_ckpt):
    """The prefetch workers' own OpenMP setting is 1 thread (a worker's team of OpenMP threads
    would throttle the model team's spin-wait, see `_one_openmp_thread`); the engine thread's
    setting and the default of threads started later are unchanged."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that "1" in the workers means something
    try:
        llm = LLM(str(tiny_ckpt), dtype="float32")
        llm.generate(inputs(2), GREEDY, use_tqdm=False)
        pool = llm.llm_engine.prefetcher._pool
        assert pool is not None and pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


def test_idle_step_starts_every_image_it_will_admit(tiny_ckpt):
    """With nothing running, the images of the requests the step will likely admit are all
    started at once, past the lookahead (prepared side by side, not one by one), and the step
    waits for them all: it admits the four together, as the synchronous path does."""
    llm = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=1)
    engine = llm.llm_engine
    submitted = []
    original = engine.prefetcher._submit

    def recording(request_id, item):
        submitted.append(request_id)
        return original(request_id, item)

    engine.prefetcher._submit = recording
    slow_process = engine.prefetcher._process
    original_wait = engine.prefetcher.wait
    step_waits = threading.Event()

    def slow(item):  # slow workers: none finishes before the step waits for them, on any host
        assert step_waits.wait(60), "the step never waited for the workers"
        return slow_process(item)

    def waiting(request_id):
        step_waits.set()
        return original_wait(request_id)

    engine.prefetcher._process = slow
    engine.prefetcher.wait = waiting
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    batch = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(i, 40 + i, 30)}} for i in range(4)]
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    assert submitted == ["r0"]  # the lookahead alone: one image ahead
    engine.step()
    assert sorted(set(submitted)) == ["r0", "r1", "r2", "r3"]  # all four started by the idle step
    assert len(engine.scheduler.running) == 4  # and admitted by it, whatever the workers' speed
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = list(out.outputs[0].token_ids)
    ref = get_llm(tiny_ckpt, async_preprocess=False).generate(batch, params, use_tqdm=False)
    assert [outs[f"r{i}"] for i in range(4)] == [list(o.outputs[0].token_ids) for o in ref]
