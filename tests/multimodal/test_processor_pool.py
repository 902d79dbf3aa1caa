"""`mm_processor_workers=N` (mmkit/multimodal/processor_pool.py): the items' processor work in
worker processes gives the serial path's tensors and greedy ids, its errors, and leaves no
process behind."""

import copy
import functools
import gc
import os
import re
import signal

import psutil
import pytest
import torch

from conftest import make_image
from mmkit import LLM, EngineArgs, RequestFailedError, SamplingParams
from mmkit.multimodal.parse import parse_prompt
from mmkit.multimodal.processor_pool import ProcessorProcessPool
from mmkit.testing.llava_next import build_tiny_anyres
from mmkit.testing.qwen2_vl import build_tiny_qwen2_vl
from qwen_ref import P_2IMG, P_IMG

LLAVA = "USER: <image>\nWhat is in the image? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BAD_WIDTH = 41  # the width `Fragile` refuses


def _family(name, tmp_path_factory):
    folder = tmp_path_factory.mktemp(name)
    if name == "qwen2_vl":
        return name, build_tiny_qwen2_vl(folder, seed=3), P_IMG, P_2IMG
    return name, build_tiny_anyres(folder), LLAVA, "USER: <image> and <image>\nCompare. ASSISTANT:"


@pytest.fixture(scope="module", params=["qwen2_vl", "llava_next"])
def family(request, tmp_path_factory):
    """Both families: the tensors, ids and errors (what depends on the processor)."""
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """One family: the pool's lifecycle (nothing in it depends on the processor)."""
    return _family("qwen2_vl", tmp_path_factory)


def batch(one, two, n=6):
    out = []
    for i in range(n):  # several sizes: different patch grids / anyres tilings
        if i % 3 == 2:
            out.append({"prompt": two, "multi_modal_data": {"image": [make_image(10 + i, 70, 40),
                                                                      make_image(20 + i, 33, 50)]}})
        else:
            out.append({"prompt": one, "multi_modal_data": {"image": make_image(30 + i, 64 + 8 * i, 48)}})
    return out


def token_ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def wait_gone(pids, timeout=60.0):
    """Wait (bounded) until none of `pids` runs. The workers are the fork server's children,
    not this process's, so `os.waitpid` cannot see them: psutil waits on any process, and an
    exited worker its parent has not reaped yet (a zombie) counts as gone."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    running = [p.pid for p in alive if _running(p)]
    assert not running, f"worker processes {running} still alive after {timeout} s"


def _running(proc) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Fragile:
    """The engine's processor, refusing one image width as a broken processor would (built in a
    worker process by `functools.partial(Fragile, factory)`, or wrapping the serial path's)."""

    def __init__(self, factory):
        self.inner = factory() if callable(factory) else factory

    def mm_item_inputs(self, item):
        frame = getattr(item, "frames", [item])[0]
        if frame.width == BAD_WIDTH:
            raise ValueError(f"{item.where}: the processor could not resize a {frame.width}-pixel-wide image")
        return self.inner.mm_item_inputs(item)


def test_pool_gives_the_serial_tensors_and_greedy_ids(family):
    name, path, one, two = family
    inputs = batch(one, two)
    serial = LLM(str(path), dtype="float32", async_preprocess=False)
    pooled = LLM(str(path), dtype="float32", mm_processor_workers=2, preprocess_lookahead=3)
    engine = pooled.llm_engine
    processes = engine.prefetcher.processes
    assert processes is not None and processes.num_workers == 2
    assert token_ids(pooled.generate(inputs, GREEDY, use_tqdm=False)) == \
        token_ids(serial.generate(inputs, GREEDY, use_tqdm=False))
    assert engine.prefetcher.num_prefetched > 0 and engine.prefetcher.num_inline == 0  # all from the workers
    # Each item's tensors, and the content hash the worker set, equal the serial path's.
    processor = serial.llm_engine.input_processor
    for i, inp in enumerate(inputs):
        for item in engine.input_processor.process(parse_prompt(i, inp)).images:
            got = processes.submit(item).result(timeout=120)
            want = processor.mm_item_inputs(item)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (name, i, key)
            fresh = copy.copy(item)
            fresh._hash = None
            assert item._hash is not None and item._hash == fresh.content_hash()


def test_processor_error_in_a_worker_is_the_serial_error(family):
    name, path, one, two = family
    inputs = batch(one, two, n=4)
    inputs.insert(1, {"prompt": one, "multi_modal_data": {"image": make_image(7, BAD_WIDTH, 31)}})
    serial = LLM(str(path), dtype="float32", async_preprocess=False)
    serial.llm_engine.input_stage.input_processor = Fragile(serial.llm_engine.input_processor)
    with pytest.raises(RequestFailedError) as want:
        serial.generate(inputs, GREEDY, use_tqdm=False)
    pooled = LLM(str(path), dtype="float32", mm_processor_workers=1)
    prefetcher = pooled.llm_engine.prefetcher
    config = pooled.llm_engine.config
    from mmkit.processors import get_input_processor

    prefetcher.processes.shutdown()  # the same engine, its workers built around `Fragile`
    prefetcher.processes = ProcessorProcessPool(functools.partial(Fragile, functools.partial(
        get_input_processor, config.model, config.tokenizer_path, config.limit_mm_per_prompt,
        config.mm_processor_kwargs)), 1)
    with pytest.raises(RequestFailedError) as got:
        pooled.generate(inputs, GREEDY, use_tqdm=False)
    assert str(got.value) == str(want.value) and "could not resize a 41-pixel-wide image" in str(got.value)
    assert list(got.value.failed) == list(want.value.failed) == [1]
    err, ref = got.value.failed[1], want.value.failed[1]
    assert type(err) is type(ref) is ValueError and str(err) == str(ref)
    assert token_ids([got.value.outputs[i] for i in (0, 2, 3, 4)]) == \
        token_ids([want.value.outputs[i] for i in (0, 2, 3, 4)])
    assert prefetcher.processes.num_workers == 1 and not prefetcher._live  # nothing left behind
    prefetcher.processes.shutdown()


def test_workers_stop_at_shutdown_and_when_the_llm_is_collected(qwen):
    _, path, one, two = qwen
    llm = LLM(str(path), dtype="float32", mm_processor_workers=2)
    llm.generate(batch(one, two, n=2), GREEDY, use_tqdm=False)
    pids = llm.llm_engine.prefetcher.processes.pids()
    assert len(pids) == 2
    del llm
    gc.collect()
    wait_gone(pids)
    llm = LLM(str(path), dtype="float32", mm_processor_workers=1)
    pids = llm.llm_engine.prefetcher.processes.pids()
    assert len(pids) == 1
    llm.llm_engine.input_stage.shutdown()
    wait_gone(pids)


@pytest.mark.parametrize("kwargs, match", [
    ({"mm_processor_workers": -1}, r"mm_processor_workers: got -1; expected an integer >= 0 \(0: the engine's "
                                   r"worker threads, N: N worker processes\)"),
    ({"mm_processor_workers": 1.5}, r"mm_processor_workers: got 1.5; expected an integer >= 0"),
    ({"mm_processor_workers": True}, r"mm_processor_workers: got True; expected an integer >= 0"),
    ({"mm_processor_workers": "2"}, r"mm_processor_workers: got '2'; expected an integer >= 0"),
    ({"mm_processor_workers": 2, "async_preprocess": False},
     r"mm_processor_workers: got 2 with async_preprocess=False; .* leave async_preprocess on or pass 0"),
])
def test_bad_mm_processor_workers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=None, **kwargs).create_engine_config()


def test_cli_and_serve_flag_reach_the_engine_args():
    from mmkit.entrypoints.cli.main import build_parser
    from mmkit.entrypoints.openai.api_server import build_engine_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--mm-processor-workers", "3"])
    assert build_engine_args(args).mm_processor_workers == 3
    assert build_engine_args(parser.parse_args(["serve"])).mm_processor_workers == 0
    assert parser.parse_args(["ask", "img.png", "Q?", "--mm-processor-workers", "2"]).mm_processor_workers == 2


def test_a_killed_worker_fails_image_requests_with_the_reason_and_the_engine_goes_on(qwen):
    _, path, one, _ = qwen
    llm = LLM(str(path), dtype="float32", mm_processor_workers=1)
    pids = llm.llm_engine.prefetcher.processes.pids()
    os.kill(pids[0], signal.SIGKILL)
    wait_gone(pids)
    with pytest.raises(RequestFailedError) as info:
        llm.generate([{"prompt": one, "multi_modal_data": {"image": make_image(1, 64, 48)}}], GREEDY, use_tqdm=False)
    err = info.value.failed[0]
    assert isinstance(err, RuntimeError)
    assert re.fullmatch(r"inputs\[0\]\.multi_modal_data\S*: the image processor's worker processes stopped "
                        r"\(.*\); this engine cannot prepare images any more: start a new one", str(err), re.S), err
    text = llm.generate(["USER: hello ASSISTANT:"], GREEDY, use_tqdm=False)  # no image: still served
    assert len(text[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_async_engine_server_path_uses_the_workers_and_stops_them(qwen):
    """The server's engine (AsyncLLMEngine) runs the same pool: the same ids as the serial
    path, the items from the workers, and its shutdown stops them."""
    import asyncio

    from mmkit import AsyncLLMEngine

    _, path, one, two = qwen
    inputs = batch(one, two, n=3)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(path), dtype="float32", mm_processor_workers=1))
    pids = engine.engine.prefetcher.processes.pids()

    async def run():
        async def one_request(i, inp):
            return [out async for out in engine.generate(inp, GREEDY, f"r{i}")][-1]
        return await asyncio.gather(*(one_request(i, inp) for i, inp in enumerate(inputs)))

    try:
        got = asyncio.run(run())
        assert engine.engine.prefetcher.num_prefetched == 4 and engine.engine.prefetcher.num_inline == 0
    finally:
        engine.shutdown()
    serial = LLM(str(path), dtype="float32", async_preprocess=False)
    assert token_ids(got) == token_ids(serial.generate(inputs, GREEDY, use_tqdm=False))
    wait_gone(pids)
