"""VQA workload (20 images x 10 questions): throughput with prefix + encoder caching on vs off.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/prefix_cache.py [--model DIR] [--dtype bfloat16]

Without --model it builds the benchmark LLaVA (SmolLM2-135M-shaped decoder, random weights).
Prints tokens/s of both runs, their ratio, vision-tower calls and cache hit rates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

QUESTIONS = ["What color is the circle?", "How many shapes are there?", "Is there a triangle?",
             "What shape is on the left?", "What color is the large shape?", "Describe the image.",
             "Is there a square?", "What color is the square?", "What shape is this?", "Is there a circle?"]


def workload(num_images: int, image_size: int):
    import numpy as np
    from PIL import Image

    items = []
    for i in range(num_images):
        rng = np.random.RandomState(i)
        img = Image.fromarray((rng.rand(image_size, image_size, 3) * 255).astype("uint8"))
        for q in QUESTIONS:
            items.append({"prompt": f"USER: <image>\n{q} ASSISTANT:", "multi_modal_data": {"image": img}})
    return items


def run(model: str, dtype: str, caching: bool, items, max_tokens: int) -> dict:
    from mmkit import LLM, SamplingParams

    kwargs = {} if caching else {"enable_prefix_caching": False, "encoder_cache_memory": 0}
    llm = LLM(model, dtype=dtype, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(items[:2], params, use_tqdm=False)  # warm-up (fills caches only for 1 image)
    start = time.perf_counter()
    outs = llm.generate(items, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    m = llm.get_metrics()
    num_tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return {"caching": caching, "seconds": elapsed, "total_tokens_per_s": num_tokens / elapsed,
            "requests_per_s": len(items) / elapsed,
            "vision_calls": llm.llm_engine.model_runner.num_vision_calls,
            "prefix_cache_hit_rate": m["prefix_cache_hits"] / max(m["prefix_cache_queries"], 1),
            "encoder_cache_hits": m["encoder_cache_hits"], "encoder_cache_misses": m["encoder_cache_misses"],
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from bench_model import build_bench_llava

        model = str(build_bench_llava())
    items = workload(args.images, 224)
    on = run(model, args.dtype, True, items, args.max_tokens)
    off = run(model, args.dtype, False, items, args.max_tokens)
    outs_on, outs_off = on.pop("outputs"), off.pop("outputs")
    same = sum(a == b for a, b in zip(outs_on, outs_off)) / len(outs_on)
    print(f"{'':10s} {'req/s':>8s} {'tok/s':>9s} {'vision calls':>13s} {'prefix hit rate':>16s}")
    for r in (on, off):
        name = "cache on" if r["caching"] else "cache off"
        print(f"{name:10s} {r['requests_per_s']:8.2f} {r['total_tokens_per_s']:9.1f} {r['vision_calls']:13d} "
              f"{r['prefix_cache_hit_rate']:16.2%}")
    ratio = on["requests_per_s"] / off["requests_per_s"]
    # float32 gives identical outputs (tests/engine/test_prefix_cache.py); in bf16 a random-weight
    # model has near-tied logits that the different attention kernels can flip.
    print(f"speedup: {ratio:.2f}x   identical greedy outputs: {same:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"on": on, "off": off, "speedup": ratio, "identical": same}, indent=2))


if __name__ == "__main__":
    main()
