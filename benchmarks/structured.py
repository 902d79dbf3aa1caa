"""Structured outputs: the cost of the grammar (xgrammar) per step and end to end.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured.py --dtype bfloat16 [--num-requests 128] [--batch 64]

1. End to end: `--num-requests` image requests, 64 greedy tokens each, run unconstrained
   (`ignore_eos`) and then constrained by a JSON schema (an array of at least 20 objects with
   enums, integers and strings, so no request completes before 64 tokens): tok/s of both.
2. Per step at a steady decode batch (`--batch`, default 64): `LLMEngine.step()` driven
   directly, only pure decode steps at the full batch counted; the grammar's work (the batch
   bitmask fill + apply in the sampler, the matchers' accept in post-processing) is timed by
   wrapping those two methods. Reports the grammar's ms per step, its share of the step, and
   the step time against the same batch unconstrained.

On a shared machine wall times swing with other processes' load, so every figure is also
given in this process's CPU time (`time.process_time`, all its threads), which other
processes disturb much less.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "objects": {
            "type": "array", "minItems": 20,
            "items": {"type": "object",
                      "properties": {"name": {"type": "string"},
                                     "color": {"enum": ["red", "green", "blue", "yellow", "purple", "orange"]},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 100},
                                     "visible": {"type": "boolean"}},
                      "required": ["name", "color", "count", "visible"]}},
    },
    "required": ["objects"],
}


def params_for(reqs, constrained: bool):
    from mmkit import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=not constrained,
                           structured_outputs=so) for r in reqs]


def end_to_end(llm, n: int, image_size: int, constrained: bool, seed: int) -> dict:
    reqs = common.make_workload("uniform", n, seed=seed, uniform_len=64)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(common.mmkit_inputs(reqs, image_size), params_for(reqs, constrained), use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if constrained:  # every output is a valid prefix of the schema's JSON (cut at 64 tokens)
        assert all(o.outputs[0].text.startswith('{"objects": [{"name": "') for o in outs)
    return {"constrained": constrained, "seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens,
            "tok_per_s": tokens / seconds}


class MethodTimer:
    """Wraps a class's method and sums its wall time (restored by `close`)."""

    def __init__(self, cls, name: str) -> None:
        self.cls, self.name, self.orig, self.total = cls, name, getattr(cls, name), 0.0
        orig = self.orig

        def timed(obj, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(obj, *args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        setattr(cls, name, timed)

    def close(self) -> None:
        setattr(self.cls, self.name, self.orig)


def per_step(llm, batch: int, steps: int, image_size: int, constrained: bool, seed: int) -> dict:
    from mmkit.structured_outputs.bitmask import GrammarBitmask
    from mmkit.structured_outputs.request import StructuredOutputRequest

    engine = llm.llm_engine
    reqs = common.make_workload("uniform", batch, seed=seed, uniform_len=steps + 8)
    for i, (inp, p) in enumerate(zip(common.mmkit_inputs(reqs, image_size), params_for(reqs, constrained))):
        engine.add_request(f"so-{seed}-{constrained}-{i}", inp, p)
    mask, accept = MethodTimer(GrammarBitmask, "apply"), MethodTimer(StructuredOutputRequest, "accept")
    step_times, cpu_times, grammar_times = [], [], []
    try:
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            pure_decode = (not engine.scheduler.waiting and len(running) == batch
                           and all(s.num_tokens - s.num_computed_tokens == 1 for s in running))
            before = mask.total + accept.total
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            elapsed = time.perf_counter() - start
            if pure_decode and len(step_times) < steps:
                step_times.append(elapsed)
                cpu_times.append(time.process_time() - cpu_start)
                grammar_times.append(mask.total + accept.total - before)
    finally:
        mask.close()
        accept.close()
    n = len(step_times)
    return {"constrained": constrained, "batch": batch, "decode_steps": n,
            "step_ms": 1e3 * sum(step_times) / n, "step_cpu_ms": 1e3 * sum(cpu_times) / n,
            "grammar_ms": 1e3 * sum(grammar_times) / n,
            "grammar_fraction": sum(grammar_times) / sum(step_times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    _, size, llm = common.setup(args)
    t0 = time.perf_counter()
    llm.llm_engine.structured_backend.compile(params_for(common.make_workload("uniform", 1), True)[0]
                                              .structured_outputs)
    compile_ms = 1e3 * (time.perf_counter() - t0)  # tokenizer info + the schema's one compile
    end_to_end(llm, 4, size, True, seed=99)  # warm-up
    # A fresh workload seed per run: the prefix and encoder caches never serve a later run.
    e2e = [end_to_end(llm, args.num_requests, size, c, seed=1 + c) for c in (False, True)]
    steps = [per_step(llm, args.batch, args.steps, size, c, seed=3 + c) for c in (False, True)]
    free, con = e2e
    print(f"{args.dtype}, {args.num_layers} layers, {torch.get_num_threads()} threads; backend setup + "
          f"compile {compile_ms:.0f} ms (once per engine / schema)")
    print(f"end to end, {args.num_requests} requests x 64 tokens: unconstrained {free['tok_per_s']:.1f} tok/s "
          f"({free['seconds']:.1f} s, CPU {free['cpu_seconds']:.1f} s), constrained {con['tok_per_s']:.1f} tok/s "
          f"({con['seconds']:.1f} s, CPU {con['cpu_seconds']:.1f} s): {con['seconds'] / free['seconds']:.3f}x the "
          f"wall time, {con['cpu_seconds'] / free['cpu_seconds']:.3f}x the CPU time")
    s_free, s_con = steps
    print(f"decode step at batch {args.batch} ({s_con['decode_steps']} steps): unconstrained "
          f"{s_free['step_ms']:.1f} ms (CPU {s_free['step_cpu_ms']:.1f} ms), constrained {s_con['step_ms']:.1f} ms "
          f"(CPU {s_con['step_cpu_ms']:.1f} ms); grammar work "
          f"{s_con['grammar_ms']:.2f} ms per step = {s_con['grammar_fraction']:.1%} of the step")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "compile_ms": compile_ms, "end_to_end": e2e,
                                               "per_step": steps}, indent=2))


if __name__ == "__main__":
    main()
