"""Decode-heavy throughput with LoRA adapters: 0, 1 and 4 distinct adapters in the batch
against the base model alone (an engine without LoRA), same process, same run.

Adapters: rank 8 (by default) on every attention and MLP projection of every decoder layer,
written in PEFT's format. "0 adapters" is the LoRA engine serving only base requests; "1": all
requests under one adapter; "4": requests round-robin over four adapters (max_loras=4, so all
four share every step). Configurations alternate within each repeat; the median of the
repeats' tokens/s is reported, with each configuration's ratio to the base.

    python benchmarks/lora_throughput.py --dtype bfloat16 --num-requests 32 --repeats 3

`--interleave`: one engine per configuration, all given the same requests, stepped in turn
(one step of each, round after round), each step timed: a host whose load drifts (a shared
machine) slows every configuration alike, so the ratios hold where whole-run timings swing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401 - sets OpenMP's environment first

from common import add_common_args, make_workload, mmkit_inputs, mmkit_params, set_threads, build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--interleave", action="store_true", help="one engine per configuration, steps alternated")
    args = p.parse_args()
    set_threads(args.threads)

    from transformers import AutoConfig

    from mmkit import LLM, LoRARequest
    from mmkit.testing.lora import decoder_shapes, write_random_adapter

    model_dir = build_model(args.num_layers, 96)
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    root = Path(tempfile.mkdtemp(prefix="mmkit-lora-bench-"))
    shapes = decoder_shapes(text)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(write_random_adapter(root / f"a{i}", shapes, seed=i, r=args.rank,
                                                                          lora_alpha=2 * args.rank)))
             for i in range(4)]
    kv = {"kv_cache_memory": 256 << 20} if args.interleave else {}
    base = LLM(model_dir, dtype=args.dtype, seed=0, **kv)

    def lora_engine():
        return LLM(model_dir, dtype=args.dtype, seed=0, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **kv)

    lora_llm = lora_engine()
    configs = {
        "base": (base, lambda n: None),
        "0 adapters": (lora_llm, lambda n: [None] * n),
        "1 adapter": (lora_engine() if args.interleave else lora_llm, lambda n: [loras[0]] * n),
        "4 adapters": (lora_engine() if args.interleave else lora_llm, lambda n: [loras[i % 4] for i in range(n)]),
    }
    # warm-up (kernel builds, adapter loads, first-step allocations)
    warm = make_workload("decode-heavy", 4, seed=999, vocab_size=text.vocab_size, max_out=8)
    for llm, lora_for in configs.values():
        llm.generate(mmkit_inputs(warm, 96), mmkit_params(warm), lora_request=lora_for(4), use_tqdm=False)
    tok_s: dict[str, list[float]] = {name: [] for name in configs}
    for rep in range(args.repeats):
        reqs = make_workload("decode-heavy", args.num_requests, seed=rep, vocab_size=text.vocab_size)
        num_out = sum(r.max_tokens for r in reqs)
        names = list(configs)[rep % 4:] + list(configs)[:rep % 4]  # each config takes every position in turn
        if args.interleave:
            for name, seconds in interleaved(configs, names, reqs).items():
                tok_s[name].append(num_out / seconds)
                print(f"repeat {rep} {name:>10}: {num_out / seconds:8.1f} tok/s (stepped in turn)", flush=True)
            continue
        for name in names:
            llm, lora_for = configs[name]
            inputs, params = mmkit_inputs(reqs, 96), mmkit_params(reqs)
            start = time.perf_counter()
            outs = llm.generate(inputs, params, lora_request=lora_for(len(reqs)), use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outs) == num_out
            tok_s[name].append(num_out / elapsed)
            print(f"repeat {rep} {name:>10}: {num_out / elapsed:8.1f} tok/s", flush=True)
    median = {name: statistics.median(v) for name, v in tok_s.items()}
    result = {"dtype": args.dtype, "num_layers": args.num_layers, "threads": args.threads, "rank": args.rank,
              "num_requests": args.num_requests, "repeats": args.repeats, "tok_s": tok_s, "median_tok_s": median,
              "ratio_to_base": {n: median[n] / median["base"] for n in configs}}
    print(f"\n{'config':>10} | median tok/s | vs base")
    for name in configs:
        print(f"{name:>10} | {median[name]:12.1f} | {median[name] / median['base']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def interleaved(configs, names, reqs) -> dict[str, float]:
    """Seconds each configuration's engine spent in `step()`, the engines stepped in turn."""
    engines = {}
    for name in names:
        llm, lora_for = configs[name]
        engine = llm.llm_engine
        loras = lora_for(len(reqs)) or [None] * len(reqs)
        for i, (inp, params, lora) in enumerate(zip(mmkit_inputs(reqs, 96), mmkit_params(reqs), loras)):
            engine.add_request(f"{name}-{i}-{id(reqs)}", inp, params, lora_request=lora)
        engines[name] = engine
    seconds = dict.fromkeys(names, 0.0)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                seconds[name] += time.perf_counter() - start
    return seconds


if __name__ == "__main__":
    sys.exit(main())
