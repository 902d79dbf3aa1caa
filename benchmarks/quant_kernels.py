"""The decoder's linear layers alone: bf16 (oneDNN, pre-packed, as mmkit runs it) vs int8 / int4
weight-only (mmkit's kernels), per batch size, in this process's CPU time.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/quant_kernels.py [--threads 1] [--layers 6] \
        [--rows 1 2 4 8 16 32 64 128 256] [--json out.json]

Shapes of the 30-layer benchmark LLaVA (SmolLM2-135M: fused qkv 960x576, o 576x576, fused
gate/up 3072x576, down 576x1536), `--layers` copies of each so that the weights do not stay in
cache between calls (as in a real step). Per row count: milliseconds for one pass over all of
them (median of `--repeats`), for bf16, and for int8 / int4 through `QuantizedLinear` (the path
the engine takes at that row count), plus each kernel forced (GEMV, tiled, dequantize + oneDNN).
CPU time rather than wall time: on a shared machine it is far less disturbed by other
processes (with one thread it is the work done; with two it also counts a worker's wake-ups).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common.set_threads(args.threads)
    from mmkit.layers.quant_pack import quantize_int4, quantize_int8
    from mmkit.layers.quantized_linear import QuantizedLinear, dequantize, quant_gemm, quant_gemm_tiled

    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in layer] for layer in weights]
    quant = {"int8": [[QuantizedLinear(quantize_int8(w), None) for w in layer] for layer in weights],
             "int4": [[QuantizedLinear(quantize_int4(w, 32), None) for w in layer] for layer in weights]}

    def timed(fn) -> float:
        fn()
        runs = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            fn()
            runs.append(1e3 * (time.process_time() - t0))
        return statistics.median(runs)

    table = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}

        def bf16() -> None:
            for layer in packed:
                for (_, k), w in zip(SHAPES, layer):
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [None], "")

        def run(mode: str, kernel=None):
            def go() -> None:
                for layer in quant[mode]:
                    for (_, k), lin in zip(SHAPES, layer):
                        lin(xs[k]) if kernel is None else kernel(xs[k], lin.qweight)
            return go

        deq = lambda x, w: F.linear(x, dequantize(w, x.dtype))  # noqa: E731
        row = {"rows": rows, "bf16_ms": timed(bf16)}
        for mode in quant:
            row[f"{mode}_ms"] = timed(run(mode))
            for name, kernel in (("gemv", quant_gemm), ("tiled", quant_gemm_tiled), ("dequant", deq)):
                if name == "gemv" and rows > 16:
                    continue
                row[f"{mode}_{name}_ms"] = timed(run(mode, kernel))
        table.append(row)
        print(f"rows {rows:4d}: bf16 {row['bf16_ms']:7.2f} ms | int8 {row['int8_ms']:7.2f} "
              f"({row['int8_ms'] / row['bf16_ms']:.2f}x) | int4 {row['int4_ms']:7.2f} "
              f"({row['int4_ms'] / row['bf16_ms']:.2f}x) | forced: " +
              " ".join(f"{k[:-3]}={v:.2f}" for k, v in row.items() if k.count("_") == 2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "shapes": SHAPES, "table": table}, indent=2))


if __name__ == "__main__":
    main()
