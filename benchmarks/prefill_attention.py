"""Attention of one prefill chunk (L new tokens over L keys, the benchmark model's 9 query and
3 KV heads of 64) three ways: the paged kernel with tiles of PREFILL_TILE rows (the engine's
path), the same kernel one row per work item (each row gathers its own context: the path of
round 4g), and one SDPA call on the dense chunk (the path of chunks it declines). Median of
`--repeats` calls each, alternating, in ms per layer.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/prefill_attention.py [--lengths 64 256 1024 2048] \
        [--dtype bfloat16 float32] [--threads 2]
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

from mmkit.layers import cpu_kernels
from mmkit.layers.attention import PREFILL_TILE, kv_cache_shape

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def problem(length: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(length)
    blocks = -(-length // BLOCK)
    k_cache = torch.randn(kv_cache_shape(blocks + 4, BLOCK, KV_HEADS, DIM), generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    table = torch.randperm(blocks + 4, generator=gen)[:blocks]
    q = torch.randn(length, HEADS, DIM, generator=gen).to(dtype)
    ids = table.expand(length, blocks).reshape(-1).contiguous()
    lens = torch.arange(1, length + 1)
    # the chunk's own K/V, dense, as SDPA gets them: [heads, L, dim] after the GQA repeat
    slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:length]
    k = k_cache.view(KV_HEADS, -1, DIM)[:, slots].repeat_interleave(HEADS // KV_HEADS, 0)
    v = v_cache.view(KV_HEADS, -1, DIM)[:, slots].repeat_interleave(HEADS // KV_HEADS, 0)
    return q, k_cache, v_cache, ids, blocks, lens, k, v


def median_ms(ways: dict, repeats: int) -> dict[str, float]:
    """Each way (a no-argument callable) once to warm up, then `repeats` rounds calling the ways in
    turn: the median time of each, ms."""
    times = {w: [] for w in ways}
    with torch.inference_mode():
        for fn in ways.values():
            fn()
        for _ in range(repeats):
            for w, fn in ways.items():
                t = time.perf_counter()
                fn()
                times[w].append(1e3 * (time.perf_counter() - t))
    return {w: statistics.median(ts) for w, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    common.set_threads(args.threads)
    scale = DIM ** -0.5
    print(f"threads {args.threads}, PREFILL_TILE {PREFILL_TILE}, ms per call (median of {args.repeats})")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for length in args.lengths:
            q, k_cache, v_cache, ids, blocks, lens, k, v = problem(length, dtype)
            tiled = torch.tensor(list(range(0, length, PREFILL_TILE)) + [length])
            single = torch.arange(length + 1)
            qs = q.transpose(0, 1)
            ways = {
                "tiles": lambda: cpu_kernels.paged_rows_attention(q, k_cache, v_cache, ids, blocks, lens, tiled, scale),
                "rows": lambda: cpu_kernels.paged_rows_attention(q, k_cache, v_cache, ids, blocks, lens, single, scale),
                "sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale),
            }
            med = median_ms(ways, args.repeats)
            print(f"{name:9s} L={length:5d}  tiles {med['tiles']:8.2f}  rows {med['rows']:8.2f}  sdpa {med['sdpa']:8.2f}"
                  f"  tiles/rows {med['tiles'] / med['rows']:.2f}  tiles/sdpa {med['tiles'] / med['sdpa']:.2f}")


if __name__ == "__main__":
    main()
