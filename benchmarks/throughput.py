"""Offline throughput: mmkit `LLM.generate` vs transformers' static-batch `generate`.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/throughput.py --dtype bfloat16 --workload mixed \
        [--num-requests 128] [--repeats 3] [--threads 2] [--num-layers 30] [--json out.json] [--rss]
        [--family qwen2_vl --num-layers 4 --vision-depth 4]   # Qwen2-VL-2B-shaped (qwen_family.py)
        [--family qwen3_vl --num-layers 4 --vision-depth 4]   # Qwen3-VL-2B-shaped (qwen_family.py)
        [--family qwen3_5 --num-layers 4 --vision-depth 4]    # Qwen3.5-2B-shaped, hybrid (qwen_family.py)

Workloads: `mixed` / `uniform` (224 px images = 196 image tokens, 16-64 text tokens) and
`decode-heavy` (96 px images = 36 image tokens, 24-40 text tokens, outputs 8-128).
`--rss` adds a fair memory comparison: each system alone in its own child process (same
workload, first repeat's seed, transformers at its best batch size), peak RSS of each.

The workload is seeded: prompts of 16-64 random text tokens after one image, output lengths
forced (mmkit `ignore_eos`, transformers `min_new_tokens = max_new_tokens`). transformers runs
the requests in arrival order in left-padded static batches, each generated to its longest
output; batch sizes 16, 32, 64 and all-at-once are tried (first repeat) and the best is kept.
Useful tokens = the requested output lengths. A greedy parity gate runs first (float32:
outputs must be identical; other dtypes: the agreement rate is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch)
import torch  # noqa: E402


# The prompts of the chosen family (`--family`): LLaVA's by default, qwen_family's for qwen2_vl.
mmkit_inputs = common.mmkit_inputs


def parity_gate(llm, hf, size: int, dtype: str, num: int, max_tokens: int) -> dict:
    reqs = common.make_workload("uniform", num, seed=12345, uniform_len=max_tokens)
    outs = llm.generate(mmkit_inputs(reqs, size), common.mmkit_params(reqs), use_tqdm=False)
    mm = [list(o.outputs[0].token_ids) for o in outs]
    ref = [hf.generate([r]).tolist()[0] for r in reqs]  # batch 1: no padding in the reference
    same_seqs = sum(a == b for a, b in zip(mm, ref))
    tok_agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(mm, ref)) / sum(len(b) for b in ref)
    # First divergence position per request (tokens after one differs are not comparable).
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(mm, ref)]
    res = {"requests": num, "identical_requests": same_seqs, "token_agreement": tok_agree,
           "mean_common_prefix": sum(prefix) / len(prefix)}
    if dtype == "float32" and same_seqs != num:
        raise SystemExit(f"parity gate FAILED in float32: {res}")
    return res


def time_mmkit(llm, reqs, size: int, ttft: list[float] | None = None) -> float:
    """Seconds for one `generate` call over `reqs`; each request's time to first token
    (from the call) is appended to `ttft` if given."""
    inputs = mmkit_inputs(reqs, size)
    params = common.mmkit_params(reqs)
    wall0 = time.time()
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if ttft is not None:
        ttft.extend(o.metrics["first_token_time"] - wall0 for o in outs)
    got = [len(o.outputs[0].token_ids) for o in outs]
    want = [r.max_tokens for r in reqs]
    if got != want:
        raise SystemExit("mmkit produced a different number of tokens than requested")
    return elapsed


def run_alone(args, system: str) -> None:
    """Child of `--rss`: one system only, one timed pass over repeat 0's workload, then its
    peak RSS (and the RSS after imports, before any model was loaded)."""
    base = common.proc_status_mb("VmRSS")["VmRSS"]
    common.set_threads(args.threads)
    common.LARGE_IMAGES = args.large_images
    image_size = common.WORKLOAD_IMAGE_SIZE[args.workload]
    model_dir = args.model or common.build_model(args.num_layers, image_size)
    size = common.image_size_of(model_dir)
    warm = common.make_workload(args.workload, 8, seed=999, uniform_len=8, max_out=16)
    reqs = common.make_workload(args.workload, args.num_requests, seed=0, uniform_len=args.uniform_len)
    useful = sum(r.max_tokens for r in reqs)
    if system == "mmkit":
        llm = common.build_llm(model_dir, args.dtype, **({"async_preprocess": False} if args.no_async_preprocess else {}))
        time_mmkit(llm, warm, size)
        t = time_mmkit(llm, reqs, size)
    else:
        hf = common.HFRunner(model_dir, args.dtype)
        hf.run_static(warm, 8)
        bs = args.hf_batch_sizes.split(",")[0]
        t = hf.run_static(reqs, len(reqs) if bs == "all" else int(bs))
    now = common.proc_status_mb("VmHWM", "VmRSS")
    Path(args.json).write_text(json.dumps({"system": system, "peak_rss_mb": max(now["VmHWM"], now["VmRSS"]),
                                           "rss_after_imports_mb": base, "tok_s": useful / t}))


def rss_alone(args, system: str, hf_batch: str | None) -> dict:
    out = Path(f"/tmp/mmkit-throughput-rss-{os.getpid()}-{system}.json")
    cmd = [sys.executable, __file__, "--only", system, "--json", str(out), "--workload", args.workload,
           "--dtype", args.dtype, "--num-layers", str(args.num_layers), "--threads", str(args.threads),
           "--num-requests", str(args.num_requests), "--uniform-len", str(args.uniform_len),
           "--hf-batch-sizes", hf_batch or "all"] + (["--large-images"] if args.large_images else [])
    if args.model:
        cmd += ["--model", args.model]
    if args.no_async_preprocess:
        cmd.append("--no-async-preprocess")
    subprocess.run(cmd, check=True)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def async_ab(args, model_dir: str, size: int, llm_on) -> None:
    """`--ab-async`: the same workloads through two engines in one process, overlapped
    preprocessing on and off (order alternating per repeat); paired throughput and TTFT."""
    llm_off = common.build_llm(model_dir, args.dtype, async_preprocess=False)
    warm = common.make_workload(args.workload, 8, seed=999, uniform_len=8, max_out=16)
    for llm in (llm_on, llm_off):
        time_mmkit(llm, warm, size)
    runs: dict[str, list] = {"on": [], "off": [], "ttft_on": [], "ttft_off": []}
    for rep in range(args.repeats):
        reqs = common.make_workload(args.workload, args.num_requests, seed=rep, uniform_len=args.uniform_len)
        useful = sum(r.max_tokens for r in reqs)
        order = [("on", llm_on), ("off", llm_off)] if rep % 2 == 0 else [("off", llm_off), ("on", llm_on)]
        for name, llm in order:
            ttft: list[float] = []
            # The prefix/encoder caches are per engine: each engine sees each workload once.
            t = time_mmkit(llm, reqs, size, ttft)
            runs[name].append(useful / t)
            runs["ttft_" + name].append(statistics.median(ttft))
            print(f"[{rep}] async_preprocess {name:3s}: {useful / t:8.1f} tok/s ({t:.1f} s), "
                  f"TTFT p50 {runs['ttft_' + name][-1]:.2f} s", flush=True)
    ratios = [a / b for a, b in zip(runs["on"], runs["off"])]
    ttft_ratios = [a / b for a, b in zip(runs["ttft_on"], runs["ttft_off"])]
    result = {"args": vars(args), "model": model_dir, "runs": runs, "throughput_ratio_per_repeat": ratios,
              "median_throughput_ratio": statistics.median(ratios), "ttft_ratio_per_repeat": ttft_ratios,
              "median_ttft_ratio": statistics.median(ttft_ratios),
              "prefetched": llm_on.llm_engine.prefetcher.num_prefetched,
              "inline": llm_on.llm_engine.prefetcher.num_inline}
    print(f"\n{args.workload} {args.dtype} {args.num_requests} req, {args.num_layers} layers, "
          f"{'1024x768 photos' if args.large_images else 'small images'}, median of {args.repeats}")
    print(f"async on  : {statistics.median(runs['on']):8.1f} tok/s, TTFT p50 {statistics.median(runs['ttft_on']):.2f} s")
    print(f"async off : {statistics.median(runs['off']):8.1f} tok/s, TTFT p50 {statistics.median(runs['ttft_off']):.2f} s")
    print(f"throughput on/off per repeat: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {result['median_throughput_ratio']:.2f}x)")
    print(f"TTFT p50 on/off per repeat  : {', '.join(f'{r:.2f}' for r in ttft_ratios)} "
          f"(median {result['median_ttft_ratio']:.2f}x)")
    print(f"images from the workers: {result['prefetched']}, computed inline: {result['inline']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--workload", default="mixed", choices=list(common.WORKLOADS))
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--uniform-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the benchmark LLaVA)")
    p.add_argument("--hf-batch-sizes", default="16,32,64,all")
    p.add_argument("--parity-requests", type=int, default=4)
    p.add_argument("--parity-tokens", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="time mmkit only")
    p.add_argument("--family", default="llava", choices=["llava", "qwen2_vl", "qwen3_vl", "qwen3_5"],
                   help="qwen2_vl / qwen3_vl: the Qwen2-VL-2B- / Qwen3-VL-2B-shaped model of qwen_family.py")
    p.add_argument("--vision-depth", type=int, default=4, help="qwen2_vl: vision blocks (the 2B has 32)")
    p.add_argument("--no-async-preprocess", action="store_true",
                   help="mmkit: image processor on the engine thread (async_preprocess=False)")
    p.add_argument("--rss", action="store_true",
                   help="also measure each system's peak RSS alone, in its own child process (llava family)")
    p.add_argument("--ab-async", action="store_true",
                   help="mmkit only: overlapped preprocessing on vs off, same workloads, one process (llava family)")
    p.add_argument("--only", choices=["mmkit", "hf"], help=argparse.SUPPRESS)  # child of --rss
    args = p.parse_args()
    if args.only:
        run_alone(args, args.only)
        return
    hf_runner = common.HFRunner
    if args.family in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        import qwen_family

        global mmkit_inputs
        mmkit_inputs, hf_runner = qwen_family.mmkit_inputs, qwen_family.QwenHFRunner
        common.set_threads(args.threads)
        build = {"qwen3_vl": qwen_family.build_bench_qwen3_vl, "qwen3_5": qwen_family.build_bench_qwen3_5}.get(
            args.family, qwen_family.build_bench_qwen2_vl)
        model_dir = args.model or build(args.num_layers, args.vision_depth)
        # A bounded KV cache (the CPU default is up to 4 GiB): both models already hold a
        # 151936-row embedding, and the machine may be shared.
        # Qwen3.5: every running sequence holds a ~3 MiB state slot (counted in the same budget),
        # so the slots are bounded to the requests of the run.
        extra = {"max_num_seqs": max(args.num_requests, 8)} if args.family == "qwen3_5" else {}
        size, llm = qwen_family.IMAGE_SIZE, common.build_llm(model_dir, args.dtype, kv_cache_memory=256 << 20,
                                                             **extra)
    else:
        model_dir, size, llm = common.setup(args, args.model)
    if args.ab_async:
        async_ab(args, model_dir, size, llm)
        return
    result: dict = {"args": vars(args), "threads": torch.get_num_threads(), "model": model_dir}
    hf = None if args.skip_hf else hf_runner(model_dir, args.dtype)
    if hf is not None:
        result["parity"] = parity_gate(llm, hf, size, args.dtype, args.parity_requests, args.parity_tokens)
        print(f"parity ({args.dtype}): {result['parity']}", flush=True)
    # Warm-up both (different seed: nothing it caches is reused by the timed runs).
    warm = common.make_workload(args.workload, 8, seed=999, uniform_len=8, max_out=16)
    time_mmkit(llm, warm, size)
    if hf is not None:
        hf.run_static(warm, 8)

    sizes = [s for s in args.hf_batch_sizes.split(",") if s]
    mm_times, hf_times, sweep, ttft_p50 = [], [], {}, []
    best = None
    for rep in range(args.repeats):
        # A fresh seed per repeat so the prefix/encoder caches never hit across repeats.
        reqs = common.make_workload(args.workload, args.num_requests, seed=rep, uniform_len=args.uniform_len)
        useful = sum(r.max_tokens for r in reqs)
        ttft: list[float] = []
        t = time_mmkit(llm, reqs, size, ttft)
        mm_times.append(useful / t)
        ttft_p50.append(statistics.median(ttft))
        print(f"[{rep}] mmkit: {useful / t:8.1f} tok/s ({t:.1f} s), TTFT p50 {ttft_p50[-1]:.2f} s "
              f"(p90 {common.percentiles(ttft)['p90']:.2f} s)", flush=True)
        if hf is None:
            continue
        candidates = sizes if best is None else [best]
        rep_best = 0.0
        for s in candidates:
            bs = len(reqs) if s == "all" else int(s)
            t = hf.run_static(reqs, bs)
            tps = useful / t
            sweep.setdefault(s, []).append(tps)
            print(f"[{rep}] hf batch {s:>4s}: {tps:8.1f} tok/s ({t:.1f} s)", flush=True)
            rep_best = max(rep_best, tps)
        if best is None:
            best = max(sweep, key=lambda k: sweep[k][0])
        hf_times.append(rep_best)

    result["mmkit_tok_s"] = statistics.median(mm_times)
    result["mmkit_runs"] = mm_times
    result["mmkit_ttft_p50_s"] = statistics.median(ttft_p50)
    result["mmkit_ttft_p50_runs"] = ttft_p50
    if hf_times:
        result["hf_tok_s"] = statistics.median(hf_times)
        result["hf_runs"] = hf_times
        result["hf_best_batch"] = best
        result["hf_sweep"] = sweep
        result["ratio"] = result["mmkit_tok_s"] / result["hf_tok_s"]
        # Each repeat runs both systems on the same workload: its ratio is a paired figure.
        result["ratio_per_repeat"] = [m / h for m, h in zip(mm_times, hf_times)]
        result["median_paired_ratio"] = statistics.median(result["ratio_per_repeat"])
    result["peak_rss_mb"] = common.peak_rss_mb()
    result["kv_bytes_per_token"] = common.kv_bytes_per_token(model_dir, args.dtype)
    state_bytes = llm.get_metrics().get("state_bytes_per_request")
    if state_bytes is not None:  # a hybrid decoder's fixed per-request state, beside its KV
        result["state_bytes_per_request"] = state_bytes
        print(f"state per request: {state_bytes / 2**20:.2f} MiB; KV per token: "
              f"{result['kv_bytes_per_token'] / 2**10:.1f} KiB")
    if args.rss:
        result["rss_alone"] = {s: rss_alone(args, s, best) for s in (["mmkit"] if hf is None else ["mmkit", "hf"])}
    print(f"\n{args.workload} {args.dtype} {args.num_requests} req, {args.num_layers} layers, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"mmkit        : {result['mmkit_tok_s']:8.1f} useful output tok/s, TTFT p50 "
          f"{result['mmkit_ttft_p50_s']:.2f} s (from the call; async_preprocess={not args.no_async_preprocess})")
    if hf_times:
        print(f"transformers : {result['hf_tok_s']:8.1f} useful output tok/s (best static batch: {best})")
        print(f"ratio        : {result['ratio']:.2f}x (median over median)")
        per = ", ".join(f"{r:.2f}" for r in result["ratio_per_repeat"])
        print(f"per repeat   : {per} (median {result['median_paired_ratio']:.2f}x)")
    print(f"peak RSS     : {result['peak_rss_mb']:.0f} MB (both systems in one process)")
    for s, r in result.get("rss_alone", {}).items():
        print(f"peak RSS {s:5s}: {r['peak_rss_mb']:.0f} MB alone in its own process "
              f"({r['rss_after_imports_mb']:.0f} MB after imports; {r['tok_s']:.1f} tok/s there)")
    print(f"KV cache     : {result['kv_bytes_per_token']} bytes per token ({args.dtype})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
