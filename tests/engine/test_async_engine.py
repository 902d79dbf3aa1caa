"""AsyncLLMEngine: streaming, aborts, per-request errors, engine failure, lifecycle."""

import asyncio
import subprocess
import sys
import time

import pytest

from conftest import get_llm, make_image
from mmkit import AsyncLLMEngine, EngineArgs, EngineDeadError, SamplingParams

PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"


@pytest.fixture()
def engine(tiny_ckpt):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", seed=0))
    yield eng
    eng.shutdown()


async def collect(engine, inputs, params, rid):
    return [out async for out in engine.generate(inputs, params, rid)]


async def wait_until_idle(engine, timeout=60.0):
    """Let the loop apply the last aborts: poll until nothing is unfinished, up to `timeout` s
    (a deadline, not a number of tries, so a slow host has the same chance as a fast one)."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_stream_matches_non_streamed(engine, tiny_ckpt):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    inputs = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}
    chunks = asyncio.run(collect(engine, inputs, params, "r1"))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    texts = [c.outputs[0].text for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    ref = get_llm(tiny_ckpt).generate(inputs, params, use_tqdm=False)[0]
    assert chunks[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert chunks[-1].outputs[0].text == ref.outputs[0].text


def test_stream_prefix_property_with_stop_strings(engine):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, stop=["zz", "ab c"])
    chunks = asyncio.run(collect(engine, "Once upon a time", params, "s"))
    texts = [c.outputs[0].text for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_fifty_concurrent_requests_and_early_break(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

        async def early(rid):
            n = 0
            async for _ in engine.generate("break early please", SamplingParams(temperature=0, max_tokens=200,
                                                                                ignore_eos=True), rid):
                n += 1
                if n == 3:
                    break
            return n

        tasks = [asyncio.create_task(collect(engine, f"prompt number {i}" if i % 3 else
                                             {"prompt": PROMPT, "multi_modal_data": {"image": make_image(i)}},
                                             params, f"req-{i}")) for i in range(50)]
        broke = await early("early")
        results = await asyncio.gather(*tasks)
        await wait_until_idle(engine)
        return broke, results

    broke, results = asyncio.run(main())
    assert broke == 3
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 20 for r in results)
    assert not engine.engine.has_unfinished_requests()
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cancel_task_aborts_request(engine):
    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancel me", SamplingParams(max_tokens=500, ignore_eos=True), "c"):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), timeout=60)  # in flight: its first token is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()


def test_abort_and_duplicate_and_bad_input(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        gen = engine.generate("long one", params, "dup")
        first = await gen.__anext__()
        assert not first.finished
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "again", params, "dup")
        with pytest.raises(ValueError, match="unknown key"):
            await collect(engine, {"promt": "x"}, params, "bad")
        good = asyncio.create_task(collect(engine, "still fine", SamplingParams(max_tokens=5), "good"))
        await engine.abort("dup")
        rest = [o async for o in gen]
        assert all(not o.finished for o in rest)
        assert (await good)[-1].finished

    asyncio.run(main())


def test_engine_failure_reaches_every_caller(engine):
    runner = engine.engine.model_runner

    def broken(sched):
        raise RuntimeError("boom")

    runner.execute_model = broken

    async def main():
        tasks = [asyncio.create_task(collect(engine, f"p{i}", SamplingParams(max_tokens=5), f"x{i}")) for i in range(5)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and isinstance(r, RuntimeError) for r in results)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "after death", SamplingParams(max_tokens=2), "y"))


def test_bad_image_fails_only_its_request(engine):
    processor = engine.engine.input_processor
    original = processor.pixel_values

    def fragile(images):
        if any(item.width == 13 for item in images):
            raise OSError("image file is truncated")  # as a lazily decoded file would
        return original(images)

    processor.pixel_values = fragile

    async def main():
        ok = asyncio.create_task(collect(engine, "healthy", SamplingParams(max_tokens=8, ignore_eos=True), "ok"))
        ok_img = asyncio.create_task(collect(engine, {"prompt": PROMPT, "multi_modal_data": {"image": make_image(3)}},
                                             SamplingParams(max_tokens=8, ignore_eos=True), "ok-img"))
        bad = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2, width=13)}}
        with pytest.raises(OSError, match="truncated"):
            await collect(engine, bad, SamplingParams(max_tokens=4), "img")
        return await ok, await ok_img

    a, b = asyncio.run(main())
    assert a[-1].finished and b[-1].finished and not engine.errored


def test_built_outside_loop_and_reused_across_loops(engine):
    params = SamplingParams(temperature=0, max_tokens=4)
    a = asyncio.run(collect(engine, "first loop", params, "l1"))
    b = asyncio.run(collect(engine, "second loop", params, "l2"))
    assert a[-1].finished and b[-1].finished


def test_interpreter_exits_with_engine_alive(tiny_ckpt):
    code = (
        "import asyncio\n"
        "from mmkit import AsyncLLMEngine, EngineArgs, SamplingParams\n"
        f"e = AsyncLLMEngine.from_engine_args(EngineArgs(model={str(tiny_ckpt)!r}, dtype='float32'))\n"
        "async def main():\n"
        "    async for o in e.generate('hi', SamplingParams(max_tokens=2), 'a'):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print('done')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done" in proc.stdout
