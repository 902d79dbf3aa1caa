"""The decoder's linear shapes of the benchmark LLaVA (fused qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536): mmkit's panel GEMM against torch's `F.linear` (oneDNN in bf16, MKL in
float32), per row count. `--layers` distinct copies of each weight, so that they come from memory
as in a real step; milliseconds for one pass over all of them, median of `--repeats`.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/panel_gemm.py [--rows 1 4 16 128 512] [--threads 2] \
        [--shape toy|qwen2-vl-2b] [--dtype bfloat16 float32] [--layers 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: F401  (sets OMP_WAIT_POLICY before torch)
import torch
import torch.nn.functional as F

from mmkit.layers import linear_panels

# (out, in) of each decoder linear, per --shape: the benchmark LLaVA's (benchmarks/bench_model.py)
# and Qwen2-VL-2B's (fused qkv 2048x1536, o 1536x1536, fused gate/up 17920x1536, down 1536x8960).
SHAPE_SETS = {
    "toy": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "qwen2-vl-2b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
}


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compare(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: list[int], layers: int, repeats: int) -> None:
    weights = [[(0.02 * torch.randn(n, k)).to(dtype) for n, k in shapes] for _ in range(layers)]
    packed = [[linear_panels.pack(w) for w in layer] for layer in weights]  # alive while bound
    panels = [[linear_panels.bind(pw, w.shape[0], None) for pw, w in zip(pl, wl)] for pl, wl in zip(packed, weights)]
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}
        ours = median_ms(lambda xs=xs: [run(xs[k]) for layer in panels for run, (_, k) in zip(layer, shapes)],
                         repeats)
        ref = median_ms(lambda xs=xs: [F.linear(xs[k], w) for layer in weights for w, (_, k) in zip(layer, shapes)],
                        repeats)
        err = max((run(xs[k]).float() - F.linear(xs[k].float(), w.float())).abs().max().item()
                  for run, w, (_, k) in zip(panels[0], weights[0], shapes))
        flops = 2 * m * layers * sum(n * k for n, k in shapes)
        print(f"{dtype!s:15s} M={m:4d} panels {ours:8.2f} ms ({flops / ours / 1e6:6.1f} GFLOPS)  "
              f"F.linear {ref:8.2f} ms ({flops / ref / 1e6:6.1f})  ratio {ours / ref:.2f}  maxerr {err:.3g}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", choices=sorted(SHAPE_SETS), default="toy")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not linear_panels.available():
        sys.exit("the panel kernels are not available on this CPU/build (AVX512-BF16 or AVX2+FMA needed)")
    for dtype in (getattr(torch, d) for d in args.dtype):
        compare(SHAPE_SETS[args.shape], dtype, args.rows, args.layers, args.repeats)


if __name__ == "__main__":
    main()
