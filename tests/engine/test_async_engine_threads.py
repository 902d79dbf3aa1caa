"""AsyncLLMEngine touches its engine from one thread only: 200 concurrent requests, the
structured ones arriving while steps run (the first one registers the grammar hook with the
runner), outputs equal to LLM.generate's."""

import asyncio
import threading

from conftest import get_llm
from mmkit import AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams

CHOICES = ["yes", "no", "a red square", "two circles"]
# Every engine method the async engine calls (reads included): processing, adding, aborting,
# stepping, metrics.
GUARDED = ("process_request", "add_processed", "abort_request", "step_result", "has_unfinished_requests",
           "get_metrics")


def guard_engine(engine):
    """Wrap the engine's methods: record each calling thread and every call that overlaps
    another (two threads inside the engine at once)."""
    threads: set[int] = set()
    overlaps: list[str] = []
    busy = threading.Lock()
    for name in GUARDED:
        method = getattr(engine, name)

        def guarded(*args, _method=method, _name=name, **kwargs):
            threads.add(threading.get_ident())
            if not busy.acquire(blocking=False):
                overlaps.append(_name)
                return _method(*args, **kwargs)
            try:
                return _method(*args, **kwargs)
            finally:
                busy.release()

        setattr(engine, name, guarded)
    return threads, overlaps


def params_of(i: int) -> SamplingParams:
    if i % 2 == 0:  # unconstrained, longer: keeps steps running while the others arrive
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(choice=CHOICES[i % len(CHOICES)::-1]))


def test_200_concurrent_requests_with_structured_outputs_mid_step(tiny_ckpt):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", seed=0))
    threads, overlaps = guard_engine(engine.engine)
    prompts = [f"Question {i}: what is in the picture?" for i in range(200)]

    async def one(i: int):
        await asyncio.sleep(0.002 * (i % 50))  # staggered: most arrive while a step runs
        last = None
        async for out in engine.generate(prompts[i], params_of(i), f"r{i}"):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(200)))

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert overlaps == [] and len(threads) == 1, (overlaps[:5], len(threads))
    ref = get_llm(tiny_ckpt).generate(prompts, [params_of(i) for i in range(200)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert all(outs[i].outputs[0].text in CHOICES for i in range(1, 200, 2))
