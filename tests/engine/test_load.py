"""Load: AsyncLLMEngine with 1,000 requests, 10% aborted, a KV cache that forces preemption.

Every request that is not aborted must finish with exactly the greedy output it gets alone;
afterwards every block is free and nothing of any request is left in the engine. Marked slow:

    python -m pytest -q -m slow tests/engine/test_load.py -s

Figures (requests completed / aborted / preempted / lost, RSS) are printed and, when
MMKIT_LOAD_REPORT names a file, written there as JSON. MMKIT_LOAD_REQUESTS overrides 1,000.
"""

import asyncio
import gc
import json
import os
import random
import time

import pytest

from conftest import get_llm, make_image
from mmkit import AsyncLLMEngine, EngineArgs, SamplingParams
from mmkit.engine.sequence import Sequence, SequenceGroup

pytestmark = pytest.mark.slow

NUM_REQUESTS = int(os.environ.get("MMKIT_LOAD_REQUESTS", "1000"))
ABORT_FRACTION = 0.10
WORDS = "the sea sky red blue circle square story tell me about a long quick brown fox image picture".split()


def make_requests(seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        num_images = rng.choice([0, 0, 0, 1, 1, 2])
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25)))
        if num_images:
            prompt = "USER: " + "<image>" * num_images + f"\n{text} ASSISTANT:"
            images = [make_image(rng.randint(0, 50), rng.randint(1, 64), rng.randint(1, 64))
                      for _ in range(num_images)]
            inputs = {"prompt": prompt, "multi_modal_data": {"image": images}}
        else:
            inputs = text
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
        abort = None
        if rng.random() < ABORT_FRACTION:  # abort after k outputs, by breaking out or by engine.abort
            abort = (rng.randint(0, 4), rng.choice(["break", "abort"]))
        requests.append({"rid": f"load-{i}", "inputs": inputs, "params": params, "abort": abort,
                         "delay": rng.random() * NUM_REQUESTS * 0.01})  # arrivals spread over the run
    return requests


def rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def count_live(cls) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


def test_async_load_with_aborts_and_preemption(tiny_ckpt):
    started = time.perf_counter()
    requests = make_requests()
    reference_llm = get_llm(tiny_ckpt)
    reference = {}
    for start in range(0, len(requests), 100):
        chunk = requests[start:start + 100]
        outs = reference_llm.generate([r["inputs"] for r in chunk], [r["params"] for r in chunk], use_tqdm=False)
        reference.update({r["rid"]: o.outputs[0].token_ids for r, o in zip(chunk, outs)})
    reference_s = time.perf_counter() - started
    rss_before = rss_mb()

    # 24 blocks of 8 tokens: a request needs at most 11; 32 running at once cannot all fit.
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", seed=0,
                                                        num_kv_blocks=24, block_size=8, max_num_seqs=32))
    inner = engine.engine
    results: dict[str, list] = {}

    async def one(req):
        await asyncio.sleep(req["delay"])
        outs = []
        gen = engine.generate(req["inputs"], req["params"], req["rid"])
        async for out in gen:
            outs.append(out)
            if req["abort"] is not None and len(outs) > req["abort"][0]:
                if req["abort"][1] == "break":
                    break
                await engine.abort(req["rid"])
        results[req["rid"]] = outs

    async def main():
        tasks = [asyncio.create_task(one(r)) for r in requests]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=1200)
        deadline = time.monotonic() + 60  # the loop applies the last aborts between steps
        while inner.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    load_started = time.perf_counter()
    asyncio.run(main())
    load_s = time.perf_counter() - load_started
    metrics = inner.get_metrics()

    completed = aborted = lost = 0
    mismatched = []
    for req in requests:
        outs = results.get(req["rid"])
        finished = bool(outs) and outs[-1].finished
        if req["abort"] is not None and not finished:
            aborted += 1
            continue
        if not finished:
            lost += 1
            continue
        completed += 1
        if outs[-1].outputs[0].token_ids != reference[req["rid"]]:
            mismatched.append(req["rid"])

    # Nothing of any request is left behind.
    assert not inner.has_unfinished_requests() and inner.groups == {}
    assert not inner.scheduler.waiting and not inner.scheduler.running
    bm = inner.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0
    assert not engine._streams and not engine._pending_adds and not engine._pending_aborts
    engine.shutdown()
    del results
    live_groups, live_seqs = count_live(SequenceGroup), count_live(Sequence)
    rss_after = rss_mb()

    figures = {
        "requests": len(requests), "with_images": sum(1 for r in requests if isinstance(r["inputs"], dict)),
        "completed": completed, "aborted": aborted, "aborted_after_finishing": sum(
            1 for r in requests if r["abort"] is not None) - aborted,
        "lost": lost, "mismatched": len(mismatched), "preemptions": metrics["num_preemptions"],
        "prefix_cache_hits_tokens": metrics["prefix_cache_hits"], "generation_tokens": metrics["generation_tokens"],
        "live_SequenceGroup_after": live_groups, "live_Sequence_after": live_seqs,
        "rss_mb_before_load": round(rss_before, 1), "rss_mb_after_load": round(rss_after, 1),
        "reference_s": round(reference_s, 1), "load_s": round(load_s, 1),
    }
    print("\nload figures:", json.dumps(figures, indent=1))
    if os.environ.get("MMKIT_LOAD_REPORT"):
        with open(os.environ["MMKIT_LOAD_REPORT"], "w") as f:
            json.dump(figures, f, indent=1)

    assert lost == 0
    assert mismatched == [], mismatched[:10]
    assert completed + aborted == len(requests)
    assert aborted > 0 and metrics["num_preemptions"] > 0
    assert live_groups == 0 and live_seqs == 0
