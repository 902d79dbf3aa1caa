"""Where a workload's time goes, step by step: decode-only steps by batch size, and steps that
carry prefill tokens, from one timed `LLM.generate` over the seeded workload.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/step_split.py --workload decode-heavy \
        [--num-requests 128] [--dtype bfloat16] [--threads 2] [--num-layers 30] [--perf out.data]

A/B a switch by running it twice, e.g. with `MMKIT_PAGED_PREFILL=0` and without. The model
runner's `execute_model` is timed (scheduling and output processing are outside it); a short
warm-up batch runs first. `--perf FILE` attaches `perf record` to this process for the timed
`generate` only (not the checkpoint build, the load or the KV cache's start-up commit); read it
with `perf report -i FILE --sort sym`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--workload", default="decode-heavy", choices=list(common.WORKLOADS))
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--perf", metavar="FILE", help="perf record the timed generate into FILE")
    p.add_argument("--perf-callgraph", action="store_true", help="with --perf: record call chains (-g)")
    args = p.parse_args()
    if args.perf and shutil.which("perf") is None:
        raise SystemExit("--perf: no `perf` on PATH (Debian: apt-get install linux-perf)")
    _, size, llm = common.setup(args)
    runner = llm.llm_engine.model_runner
    execute = runner.execute_model
    steps: list[tuple[int, int, float]] = []  # (tokens, sequences, seconds)

    def timed(sched):
        t = time.perf_counter()
        out = execute(sched)
        n = sched.num_scheduled_tokens
        steps.append((sum(n.values()), len(n), time.perf_counter() - t))
        return out

    runner.execute_model = timed
    model = runner.model
    embed = model.embed_multimodal
    vision: list[float] = []  # seconds per embed_multimodal call (inside the prefill steps)

    def timed_embed(items):
        t = time.perf_counter()
        out = embed(items)
        vision.append(time.perf_counter() - t)
        return out

    model.embed_multimodal = timed_embed
    warm = common.make_workload(args.workload, 8, seed=999, uniform_len=8, max_out=16)
    llm.generate(common.mmkit_inputs(warm, size), common.mmkit_params(warm), use_tqdm=False)
    steps.clear()
    vision.clear()
    reqs = common.make_workload(args.workload, args.num_requests, seed=0)
    perf = None
    if args.perf:
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "499", *(["-g"] if args.perf_callgraph else []),
                                 "-o", args.perf, "-p", str(os.getpid())])
        time.sleep(1.0)  # perf attaches to every thread before the run starts
    t = time.perf_counter()
    llm.generate(common.mmkit_inputs(reqs, size), common.mmkit_params(reqs), use_tqdm=False)
    wall = time.perf_counter() - t
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    useful = sum(r.max_tokens for r in reqs)
    decode = [(s, d) for tok, s, d in steps if tok == s]
    mixed = [(tok, s, d) for tok, s, d in steps if tok != s]
    print(f"{args.workload} {args.dtype} {args.num_requests} req: wall {wall:.2f} s, {useful / wall:.1f} tok/s, "
          f"{len(steps)} steps, {sum(d for *_, d in steps):.2f} s in the runner")
    print(f"decode-only steps: {len(decode)}, {sum(d for _, d in decode):.2f} s, {sum(s for s, _ in decode)} rows")
    print(f"steps with prefill: {len(mixed)}, {sum(d for *_, d in mixed):.2f} s, {sum(t for t, _, _ in mixed)} tokens"
          f" (of which the vision encoder: {len(vision)} calls, {sum(vision):.2f} s)")
    by_size: dict[int, list[float]] = collections.defaultdict(list)
    for s, d in decode:
        by_size[1 << (s.bit_length() - 1)].append(d)
    for b in sorted(by_size):
        ds = by_size[b]
        print(f"  decode batch {b}-{2 * b - 1}: {len(ds)} steps, {1000 * sum(ds) / len(ds):.1f} ms/step")
    for tok, s, d in mixed:
        print(f"  step with prefill: {tok} tokens, {s} sequences, {1000 * d:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "workload": args.workload, "dtype": args.dtype, "num_requests": args.num_requests, "wall_s": wall,
            "vision_s": sum(vision), "useful_tok_per_s": useful / wall, "steps": [{"tokens": t, "seqs": s, "s": d} for t, s, d in steps]}))


if __name__ == "__main__":
    main()
