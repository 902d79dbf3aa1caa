"""The transformers backend beside the native path and transformers' own best static batch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/transformers_backend.py [--families llava,qwen2_vl]
        [--dtypes bfloat16,float32] [--num-requests 32] [--repeats 3] [--threads 2]
        [--llava-layers 30] [--qwen-layers 4 --vision-depth 2] [--out DIR]

For each family (the benchmark LLaVA of bench_model.py, the Qwen2-VL-2B-shaped checkpoint of
qwen_family.py) and dtype, one process times, on the same seeded decode-heavy workload (96 px /
224 px images, 24-40 text tokens, outputs 8-128, EOS ignored):

- mmkit native (`model_impl="mmkit"`),
- mmkit on the transformers backend (`model_impl="transformers"`),
- transformers' `generate` in left-padded static batches (16, 32, all; the best of the first
  repeat kept),

each the median of `--repeats` runs (a fresh seed per repeat: no cache hits across repeats),
in useful output tokens per second. A float32 greedy gate checks first that the backend's ids
equal the native path's. Goals (issue 54): backend >= 2x transformers, >= 0.6x native.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch)
import torch  # noqa: E402


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown CPU"


def family_setup(family: str, args):
    """(model_dir, image_size, mmkit inputs function, transformers runner class, LLM kwargs)."""
    if family == "llava":
        size = common.WORKLOAD_IMAGE_SIZE["decode-heavy"]
        return common.build_model(args.llava_layers, size), size, common.mmkit_inputs, common.HFRunner, {}
    import qwen_family

    model_dir = qwen_family.build_bench_qwen2_vl(args.qwen_layers, args.vision_depth)
    return (model_dir, qwen_family.IMAGE_SIZE, qwen_family.mmkit_inputs, qwen_family.QwenHFRunner,
            {"kv_cache_memory": 256 << 20})


def time_llm(llm, inputs_fn, reqs, size) -> float:
    params = common.mmkit_params(reqs)
    start = time.perf_counter()
    outs = llm.generate(inputs_fn(reqs, size), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.max_tokens for r in reqs]
    return elapsed


def run_family(family: str, dtype: str, args) -> dict:
    from mmkit import LLM

    model_dir, size, inputs_fn, hf_cls, kw = family_setup(family, args)
    llms = {impl: LLM(model_dir, dtype=dtype, seed=0, model_impl=impl, **kw) for impl in ("mmkit", "transformers")}
    gate = common.make_workload("uniform", 4, seed=4321, uniform_len=16)
    ids = {impl: [list(o.outputs[0].token_ids) for o in
                  llm.generate(inputs_fn(gate, size), common.mmkit_params(gate), use_tqdm=False)]
           for impl, llm in llms.items()}
    same = sum(a == b for a, b in zip(ids["mmkit"], ids["transformers"]))
    if dtype == "float32" and same != len(gate):
        raise SystemExit(f"{family}: the backend's float32 ids differ from the native path's")
    hf = hf_cls(model_dir, dtype)
    warm = common.make_workload("decode-heavy", 4, seed=999, max_out=8)
    for llm in llms.values():
        time_llm(llm, inputs_fn, warm, size)
    hf.run_static(warm, 4)
    sizes = [s for s in args.hf_batch_sizes.split(",") if s]
    runs: dict[str, list[float]] = {"mmkit": [], "transformers_backend": [], "hf": []}
    best = None
    for rep in range(args.repeats):
        reqs = common.make_workload("decode-heavy", args.num_requests, seed=rep)
        useful = sum(r.max_tokens for r in reqs)
        for impl, name in (("mmkit", "mmkit"), ("transformers", "transformers_backend")):
            runs[name].append(useful / time_llm(llms[impl], inputs_fn, reqs, size))
        rep_best = 0.0
        for s in (sizes if best is None else [best]):
            tps = useful / hf.run_static(reqs, len(reqs) if s == "all" else int(s))
            if tps > rep_best:
                rep_best, rep_size = tps, s
        best = best or rep_size
        runs["hf"].append(rep_best)
        print(f"  [{family} {dtype} {rep}] native {runs['mmkit'][-1]:.1f}  backend {runs['transformers_backend'][-1]:.1f}"
              f"  transformers {rep_best:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"family": family, "dtype": dtype, "model": model_dir, "requests": args.num_requests,
            "greedy_gate_identical": f"{same}/{len(gate)}", "runs_tok_s": runs, "median_tok_s": med,
            "hf_best_batch": best, "backend_vs_hf": med["transformers_backend"] / med["hf"],
            "backend_vs_native": med["transformers_backend"] / med["mmkit"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llava,qwen2_vl")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llava-layers", type=int, default=30)
    p.add_argument("--qwen-layers", type=int, default=4)
    p.add_argument("--vision-depth", type=int, default=2)
    p.add_argument("--hf-batch-sizes", default="16,32,all")
    p.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = p.parse_args()
    common.set_threads(args.threads)
    results = [run_family(f, d, args) for f in args.families.split(",") for d in args.dtypes.split(",")]
    cpu = cpu_name()
    lines = [f"decode-heavy, {args.num_requests} requests, median of {args.repeats}, {args.threads} threads, {cpu}",
             "", "| family | dtype | native tok/s | backend tok/s | transformers tok/s (batch) | backend / transformers "
             "| backend / native |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        m = r["median_tok_s"]
        lines.append(f"| {r['family']} | {r['dtype']} | {m['mmkit']:.1f} | {m['transformers_backend']:.1f} | "
                     f"{m['hf']:.1f} ({r['hf_best_batch']}) | {r['backend_vs_hf']:.2f}x | {r['backend_vs_native']:.2f}x |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"cpu": cpu, "args": vars(args), "torch": torch.__version__,
                                                      "results": results}, indent=2))
        (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
