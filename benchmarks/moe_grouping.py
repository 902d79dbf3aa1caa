"""One MoE MLP step of 64 decode rows vs 64 single-row steps (mmkit's grouped experts).

    python benchmarks/moe_grouping.py [--experts 64 --top-k 8 --hidden 1024 --inter 384]
        [--rows 64] [--runs 5] [--dtype bfloat16] [--threads 2] [--no-pack] [--json out.json]

Builds models/moe.py's `SparseMoeBlock` (Qwen3-VL-30B-A3B's routing: softmax top-k,
renormalised) with random weights, shape scaled down (the 30B-A3B block is 128 experts, top-8,
hidden 2048, moe_intermediate 768), packed as the engine packs it (bf16 on CPU: oneDNN layout;
`--no-pack` for the unpacked A/B). Two predictions of time(64 single-row steps) / time(one
64-row step):

- count model: an expert's matmuls cost the time to read its weights whatever their row count
  (true when weight-read-bound), so the ratio is the ratio of expert calls,
  (rows * top_k) / experts hit by the rows: each single row runs top_k experts, the batch
  runs each expert it hits once. 64 * 8 / 64 = 8x here.
- calibrated: the expert MLPs alone, timed in this run at the row counts each mode gives them
  (rows * top_k one-row calls vs one call per hit expert with its n_e rows),
  sum t_e(1) / sum t_e(n_e). It departs from the count model when a matmul's cost grows with
  its rows (float32 on this CPU: MKL's sgemm is compute-bound at 8 rows); the gap between it
  and the measured ratio is the grouping's own cost (routing, argsort, gather, scatter, loop).

Times are medians over `--runs`; within a run the two sides of each ratio are interleaved in 8
slices (the 64-row step once per slice, 1/8 of the single-row steps), and each ratio is the
median of its per-run ratios.
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
    ap.add_argument("--no-pack", action="store_true", help="bf16: leave the experts unpacked (F.linear)")
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
    if not args.no_pack:
        block.pack()  # what prepare_for_inference does (a no-op in float32)
    x = torch.randn(args.rows, args.hidden, dtype=dtype)
    with torch.inference_mode():
        experts = block.gate(x)[1]  # [rows, k]
        hit = int(experts.unique().numel())
        counts = torch.bincount(experts.reshape(-1), minlength=args.experts).tolist()
        grouped_rows = {e: torch.randn(n, args.hidden, dtype=dtype) for e, n in enumerate(counts) if n}
        one_rows = [(int(e), x[i:i + 1]) for i in range(args.rows) for e in experts[i]]

        # One run interleaves the modes in 8 slices: a slice times the 64-row step (and the
        # grouped expert MLPs) once and 1/8 of the single-row steps (and of the one-row MLPs),
        # so both sides of a ratio sample the same moments of a machine whose load changes.
        singles = [lambda i=i: block(x[i:i + 1]) for i in range(args.rows)]
        one_row = [lambda e=e, r=r: block.experts._expert(e, r) for e, r in one_rows]
        pairs = {"batched": (lambda: block(x), "singles", singles),
                 "experts_grouped": (lambda: [block.experts._expert(e, r) for e, r in grouped_rows.items()],
                                     "experts_one_row", one_row)}
        slices = 8
        for whole, _, parts in pairs.values():  # warm-up
            whole()
            for fn in parts:
                fn()
        times: dict[str, list[float]] = {k: [] for name, (_, other, _) in pairs.items() for k in (name, other)}
        for _ in range(args.runs):
            for name, (whole, other, parts) in pairs.items():
                t_whole = t_parts = 0.0
                per = -(-len(parts) // slices)
                for j in range(slices):
                    start = time.perf_counter()
                    whole()
                    t_whole += time.perf_counter() - start
                    start = time.perf_counter()
                    for fn in parts[j * per:(j + 1) * per]:
                        fn()
                    t_parts += time.perf_counter() - start
                times[name].append(t_whole / slices)
                times[other].append(t_parts)
    med = {name: statistics.median(t) for name, t in times.items()}
    count_model = args.rows * args.top_k / hit
    # Paired per run (the two modes of a ratio ran back to back), then the median: steadier
    # than a ratio of medians when the machine's load changes during the runs.
    measured = statistics.median(s / b for s, b in zip(times["singles"], times["batched"]))
    calibrated = statistics.median(s / b for s, b in zip(times["experts_one_row"], times["experts_grouped"]))
    packed = block.experts._packed is not None
    result = dict(rows=args.rows, experts=args.experts, top_k=args.top_k, hidden=args.hidden, inter=args.inter,
                  dtype=args.dtype, threads=args.threads, packed=packed, experts_hit=hit,
                  batched_ms=med["batched"] * 1e3, singles_ms=med["singles"] * 1e3,
                  experts_grouped_ms=med["experts_grouped"] * 1e3, experts_one_row_ms=med["experts_one_row"] * 1e3,
                  measured_ratio=measured, predicted_ratio=count_model, calibrated_ratio=calibrated,
                  grouping_overhead_ms=(med["batched"] - med["experts_grouped"]) * 1e3,
                  single_overhead_ms=(med["singles"] - med["experts_one_row"]) * 1e3,
                  runs={k: [t * 1e3 for t in v] for k, v in times.items()})
    print(f"MoE {args.experts} experts top-{args.top_k} h{args.hidden} i{args.inter} {args.dtype}"
          f"{' packed' if packed else ''}, {args.threads} threads, median of {args.runs}:")
    print(f"  one {args.rows}-row step {med['batched'] * 1e3:.1f} ms ({hit} experts hit; their MLPs alone "
          f"{med['experts_grouped'] * 1e3:.1f} ms)")
    print(f"  {args.rows} single-row steps {med['singles'] * 1e3:.1f} ms ({args.rows * args.top_k} one-row expert "
          f"MLPs alone {med['experts_one_row'] * 1e3:.1f} ms)")
    print(f"  measured {measured:.1f}x; count model (rows*k/hit = {args.rows}*{args.top_k}/{hit}) predicts "
          f"{count_model:.1f}x; calibrated (expert MLP times at these row counts) predicts {calibrated:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
