"""One MoE MLP step of 64 decode rows vs 64 single-row steps (mmkit's grouped experts).

    python benchmarks/moe_grouping.py [--experts 64 --top-k 8 --hidden 1024 --inter 384]
        [--rows 64] [--runs 5] [--dtype bfloat16] [--threads 2] [--json out.json]

Builds models/moe.py's `SparseMoeBlock` (Qwen3-VL-30B-A3B's routing: softmax top-k,
renormalised) with random weights, shape scaled down (the 30B-A3B block is 128 experts, top-8,
hidden 2048, moe_intermediate 768). At decode sizes an expert's matmul costs about the time to
read its weights, whatever its row count, so the grouping predicts

    time(64 single-row steps) / time(one 64-row step) ~= (64 * top_k) / experts hit by the 64 rows

(each single row runs top_k experts; the batch runs each expert it hits once). The script
reports the measured ratio (median over `--runs`, the two modes alternating) next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mmkit.models.moe import SparseMoeBlock  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = SimpleNamespace(num_experts=args.experts, num_experts_per_tok=args.top_k, hidden_size=args.hidden,
                             moe_intermediate_size=args.inter, hidden_act="silu")
    dtype = getattr(torch, args.dtype)
    block = SparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    block = block.to(dtype).eval()
    x = torch.randn(args.rows, args.hidden, dtype=dtype)
    with torch.inference_mode():
        hit = int(block.gate(x)[1].unique().numel())
        block(x), block(x[:1])  # warm-up

        def batched() -> float:
            start = time.perf_counter()
            block(x)
            return time.perf_counter() - start

        def singles() -> float:
            start = time.perf_counter()
            for i in range(args.rows):
                block(x[i:i + 1])
            return time.perf_counter() - start

        one, many = [], []
        for _ in range(args.runs):
            one.append(batched())
            many.append(singles())
    t_one, t_many = statistics.median(one), statistics.median(many)
    result = dict(rows=args.rows, experts=args.experts, top_k=args.top_k, hidden=args.hidden, inter=args.inter,
                  dtype=args.dtype, threads=args.threads, experts_hit=hit,
                  batched_ms=t_one * 1e3, singles_ms=t_many * 1e3, measured_ratio=t_many / t_one,
                  predicted_ratio=args.rows * args.top_k / hit)
    print(f"MoE {args.experts} experts top-{args.top_k} h{args.hidden} i{args.inter} {args.dtype}: one {args.rows}-row "
          f"step {t_one * 1e3:.1f} ms ({hit} experts hit), {args.rows} single-row steps {t_many * 1e3:.1f} ms: "
          f"measured {t_many / t_one:.1f}x, grouping predicts {args.rows * args.top_k / hit:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
