"""Latency: time to first token (TTFT) and time per output token (TPOT), p50/p90/p99.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/latency.py --dtype bfloat16 [--num-layers 30] \
        [--batch1-requests 5] [--output-len 64] [--load-requests 48 --rate 1.0] [--json out.json]

Batch 1: one request at a time, both systems. mmkit through `LLMEngine.step()` (timestamps of
the steps that emit each token); transformers through `generate` with a streamer whose `put`
is called once per new token. TPOT is every inter-token gap; TTFT from the call to the first
token (includes image processing, vision tower and prefill for both).

Steady load (mmkit only: transformers' `generate` has no request-level scheduling, so a
request arriving mid-batch waits for the whole batch; its static-batch figures are in
throughput.py): Poisson arrivals at `--rate` requests/s into an `engine.step()` loop; TTFT
from arrival, TPOT as each request's mean inter-token time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402


def mmkit_batch1(llm, reqs, size: int, cpu_gaps: list[float] | None = None) -> tuple[list[float], list[float]]:
    """TTFT and inter-token gaps (wall); `cpu_gaps` gets the same gaps in this process's CPU
    time (all threads), which a shared, loaded machine disturbs less than wall time."""
    engine = llm.llm_engine
    ttft, gaps = [], []
    for i, (inp, params) in enumerate(zip(common.mmkit_inputs(reqs, size), common.mmkit_params(reqs))):
        start = time.perf_counter()
        engine.add_request(f"b1-{time.monotonic_ns()}-{i}", inp, params)
        stamps, cpu, seen = [], [], 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            now, now_cpu = time.perf_counter(), time.process_time()
            for o in outs:
                n = len(o.outputs[0].token_ids)
                stamps.extend([now] * (n - seen))
                cpu.extend([now_cpu] * (n - seen))
                seen = n
        ttft.append(stamps[0] - start)
        gaps.extend(b - a for a, b in zip(stamps, stamps[1:]))
        if cpu_gaps is not None:
            cpu_gaps.extend(b - a for a, b in zip(cpu, cpu[1:]))
    return ttft, gaps


class _StampStreamer:
    """transformers streamer: `put` gets the prompt once, then each new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_batch1(hf, reqs) -> tuple[list[float], list[float]]:
    ttft, gaps = [], []
    for r in reqs:
        streamer = _StampStreamer()
        start = time.perf_counter()
        hf.generate([r], streamer=streamer)
        s = streamer.stamps
        ttft.append(s[0] - start)
        gaps.extend(b - a for a, b in zip(s, s[1:]))
    return ttft, gaps


def mmkit_under_load(llm, reqs, size: int, rate: float, seed: int = 0) -> dict:
    engine = llm.llm_engine
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    items = list(zip(common.mmkit_inputs(reqs, size), common.mmkit_params(reqs)))
    first, last, count, arrived_at = {}, {}, {}, {}
    nxt = 0
    start = time.perf_counter()
    max_running = 0
    while nxt < len(items) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(items) and arrivals[nxt] <= now:
            rid = f"load-{seed}-{nxt}"
            engine.add_request(rid, *items[nxt])
            arrived_at[rid] = start + arrivals[nxt]
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        max_running = max(max_running, len(engine.scheduler.running))
        outs = engine.step()
        stamp = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = stamp
            if n:
                last[o.request_id] = stamp
                count[o.request_id] = n
    elapsed = time.perf_counter() - start
    ttft = [first[r] - arrived_at[r] for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return {"rate_req_s": rate, "requests": len(reqs), "max_running": max_running,
            "output_tok_s": sum(count.values()) / elapsed,
            "ttft_s": common.percentiles(ttft), "tpot_s": common.percentiles(tpot)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--batch1-requests", type=int, default=5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--load-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (requests/s) of the load run")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-load", action="store_true")
    args = p.parse_args()
    model_dir, size, llm = common.setup(args)
    hf = None if args.skip_hf else common.HFRunner(model_dir, args.dtype)
    warm = common.make_workload("uniform", 1, seed=999, uniform_len=4)
    mmkit_batch1(llm, warm, size)
    if hf is not None:
        hf_batch1(hf, warm)

    reqs = common.make_workload("uniform", args.batch1_requests, seed=1, uniform_len=args.output_len)
    result: dict = {"args": vars(args), "threads": torch.get_num_threads(), "peak_rss_mb": 0.0,
                    "weights": {k: v for k, v in llm.get_metrics().items() if k.endswith("weight_bytes")}}
    cpu_gaps: list[float] = []
    ttft, gaps = mmkit_batch1(llm, reqs, size, cpu_gaps)
    result["mmkit_batch1"] = {"ttft_s": common.percentiles(ttft), "tpot_s": common.percentiles(gaps),
                              "tpot_cpu_s": common.percentiles(cpu_gaps)}
    if hf is not None:
        ttft, gaps = hf_batch1(hf, reqs)
        result["hf_batch1"] = {"ttft_s": common.percentiles(ttft), "tpot_s": common.percentiles(gaps)}
        # A second mmkit pass after transformers, so slow drifts of the machine hit both systems
        # (a fresh seed: the same images would hit mmkit's prefix and encoder caches).
        again = common.make_workload("uniform", args.batch1_requests, seed=3, uniform_len=args.output_len)
        ttft2, gaps2 = mmkit_batch1(llm, again, size)
        result["mmkit_batch1_again"] = {"ttft_s": common.percentiles(ttft2), "tpot_s": common.percentiles(gaps2)}
        m = result["mmkit_batch1"]["tpot_s"]["p50"]
        result["tpot_p50_ratio"] = min(m, result["mmkit_batch1_again"]["tpot_s"]["p50"]) / \
            result["hf_batch1"]["tpot_s"]["p50"]
    if not args.skip_load:
        load = common.make_workload("mixed", args.load_requests, seed=2)
        result["mmkit_load"] = mmkit_under_load(llm, load, size, args.rate)

    result["peak_rss_mb"] = common.peak_rss_mb()

    def fmt(d):
        return " ".join(f"{k}={1e3 * v:.1f}ms" for k, v in d.items())

    print(f"\n{args.dtype}, {args.num_layers} layers, {torch.get_num_threads()} threads, output {args.output_len}")
    for name in ("mmkit_batch1", "mmkit_batch1_again", "hf_batch1"):
        if name in result:
            print(f"{name:20s} TTFT {fmt(result[name]['ttft_s'])} | TPOT {fmt(result[name]['tpot_s'])}")
    if "tpot_p50_ratio" in result:
        print(f"batch-1 TPOT p50 mmkit / transformers: {result['tpot_p50_ratio']:.2f}x")
    if "mmkit_load" in result:
        ld = result["mmkit_load"]
        print(f"mmkit under load ({ld['rate_req_s']} req/s, {ld['requests']} requests, up to {ld['max_running']} "
              f"running, {ld['output_tok_s']:.1f} tok/s): TTFT {fmt(ld['ttft_s'])} | TPOT {fmt(ld['tpot_s'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
