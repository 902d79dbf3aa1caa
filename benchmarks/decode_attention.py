"""Decode attention alone: GB/s of K/V read by the paged decode kernel, from cache and from DRAM.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_attention.py [--dtype bfloat16 float32] \
        [--threads 2] [--repeats 7] [--baseline REV] [--block-size 16]

One call attends one query token per sequence over its whole context (the engine's decode
rows), reading every live K and V row of one layer once; GB/s = those bytes / the call's time.
Two placements of the same shapes:
- "cache": one layer's cache, called again and again (shapes whose K/V fit in `--cache-bytes`,
  about half of L3, so after the first call the reads hit it);
- "dram": enough layers' caches (each the shape's size) to exceed `--dram-bytes`, called in turn
  as a decode step walks its layers, so each call's K/V was evicted by the others.
Blocks are scattered (a random permutation of the pool), as the block manager hands them out.

`--baseline REV` builds `mmkit/layers/csrc/` as committed at REV (same compiler and flags) and
times it against this tree's kernel in the same process, the two alternating call batch by call
batch, and checks that both give the same outputs. Each figure is the median of `--repeats`
batches, with the range. The CPU (lscpu's model name and the ISA the kernel was built for) is
printed first.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: F401  (sets OMP_WAIT_POLICY before torch)
import torch

from mmkit.layers import cpu_kernels
from mmkit.layers.attention import kv_cache_shape

ROOT = Path(__file__).resolve().parent.parent
CSRC = "mmkit/layers/csrc"


@dataclass(frozen=True)
class Shape:
    name: str
    seqs: int
    context: int
    heads: int
    kv_heads: int
    head_dim: int


# Llama-3-8B-like GQA heads (32 query / 8 KV of 64 here, as the issue names) at a few batch and
# context sizes, Qwen2.5-7B's (28 / 4 of 128), Qwen2-VL-2B's (12 / 2 of 128), and the benchmark LLaVA's decoder
# (benchmarks/bench_model.py: 9 / 3 heads of 64).
SHAPES = (
    Shape("gqa32/8 8x512", 8, 512, 32, 8, 64),
    Shape("gqa32/8 32x1024", 32, 1024, 32, 8, 64),
    Shape("gqa32/8 8x4096", 8, 4096, 32, 8, 64),
    Shape("gqa28/4 d128 8x512", 8, 512, 28, 4, 128),
    Shape("gqa12/2 d128 32x512", 32, 512, 12, 2, 128),
    Shape("toy9/3 32x512", 32, 512, 9, 3, 64),
    Shape("toy9/3 128x300", 128, 300, 9, 3, 64),
)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    keep = ("Model name", "CPU family", "Model", "L2 cache", "L3 cache")
    return ", ".join(f"{k}: {fields[k].strip()}" for k in keep if k in fields)


def build_baseline(rev: str, folder: Path) -> ctypes.CDLL:
    """mmkit/layers/csrc at `rev`, compiled as cpu_kernels builds this tree's (same flags)."""
    src = folder / "csrc"
    src.mkdir()
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"], capture_output=True,
                              check=True).stdout
        (src / name).write_bytes(blob)
    target = folder / "baseline.so"
    subprocess.run(["cc", *cpu_kernels.build_flags(), *map(str, sorted(src.glob("*.c"))), "-o", str(target), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(target))
    fn = lib.mmkit_paged_decode_attention
    fn.argtypes, fn.restype = cpu_kernels._SIGNATURES["mmkit_paged_decode_attention"]
    return lib


class Problem:
    """`layers` caches of one shape, a scattered block table, queries; `run(lib, layer)` is one call."""

    def __init__(self, shape: Shape, dtype: torch.dtype, block_size: int, layers: int, seed: int = 0,
                 layout: str = "scattered"):
        gen = torch.Generator().manual_seed(seed)
        self.shape, self.dtype = shape, dtype
        self.max_blocks = -(-shape.context // block_size)
        self.num_blocks = shape.seqs * self.max_blocks + 1
        self.block_size = block_size
        cache_shape = kv_cache_shape(self.num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.caches = [(torch.randn(cache_shape, generator=gen).to(dtype),
                        torch.randn(cache_shape, generator=gen).to(dtype)) for _ in range(layers)]
        order = torch.randperm(self.num_blocks, generator=gen) if layout == "scattered" else torch.arange(self.num_blocks)
        self.block_ids = order[:shape.seqs * self.max_blocks].contiguous()
        self.lens = torch.full((shape.seqs,), shape.context, dtype=torch.long)
        self.q = torch.randn(shape.seqs, shape.heads, shape.head_dim, generator=gen).to(dtype)
        self.out = torch.empty_like(self.q)
        self.scale = shape.head_dim ** -0.5
        self.kv_bytes = 2 * shape.seqs * shape.context * shape.kv_heads * shape.head_dim * self.q.element_size()

    def run(self, lib: ctypes.CDLL, layer: int, threads: int) -> None:
        s = self.shape
        k, v = self.caches[layer]
        status = lib.mmkit_paged_decode_attention(
            self.out.data_ptr(), self.q.data_ptr(), self.q.stride(0), k.data_ptr(), v.data_ptr(),
            self.block_ids.data_ptr(), self.max_blocks, self.lens.data_ptr(), None, s.seqs, s.heads, s.kv_heads,
            s.head_dim, self.num_blocks, self.block_size, self.scale, cpu_kernels._DTYPES[self.dtype], threads)
        if status != 0:
            raise RuntimeError(f"kernel status {status}")


def batch_gbps(problem: Problem, lib: ctypes.CDLL, threads: int, calls: int, cycle: bool) -> tuple[float, float]:
    """GB/s of K/V over `calls` calls (cycling through the layers when `cycle`), and of its fastest call."""
    layers = len(problem.caches)
    fastest = float("inf")
    first = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        problem.run(lib, i % layers if cycle else 0, threads)
        fastest = min(fastest, time.perf_counter() - t)
    total = time.perf_counter() - first
    return problem.kv_bytes * calls / total / 1e9, problem.kv_bytes / fastest / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dram-bytes", type=float, default=512e6, help="K/V bytes cycled through for 'dram'")
    ap.add_argument("--cache-bytes", type=float, default=16e6,
                    help="largest K/V of one call timed as 'cache' (about half this host's L3)")
    ap.add_argument("--min-seconds", type=float, default=0.05, help="least time of one timed batch")
    ap.add_argument("--shapes", nargs="+", help="names of SHAPES to run (default: all)")
    ap.add_argument("--baseline", help="a git revision whose kernel runs beside this tree's")
    ap.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered",
                    help="block tables: a random permutation of the pool, or each sequence's blocks in a row")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("the CPU kernels are unavailable")
    print(f"CPU: {cpu_name()}")
    print(f"kernel flags: {' '.join(cpu_kernels.build_flags())}; AVX-512: {bool(lib.mmkit_has_avx512())}; "
          f"threads {args.threads}; block size {args.block_size}; {args.layout} blocks; median of {args.repeats} batches (min-max)")
    libs = {"this tree": lib}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        libs = {f"baseline {args.baseline}": build_baseline(args.baseline, Path(tmp.name)), "this tree": lib}
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    header = "| shape | dtype | placement | MB per call | " + " | ".join(f"{n} GB/s median (range) / best" for n in libs)
    if args.baseline:
        header += " | ratio of medians / of bests"
    print(header + " |")
    print("|" + " --- |" * (header.count("|")))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for shape in shapes:
            one = Problem(shape, dtype, args.block_size, 1, layout=args.layout)
            layers = max(2, int(args.dram_bytes // one.kv_bytes) + 1)
            for placement in ("cache", "dram") if one.kv_bytes <= args.cache_bytes else ("dram",):
                problem = one if placement == "cache" else Problem(shape, dtype, args.block_size, layers, layout=args.layout)
                outs = []
                for fn in libs.values():  # warm-up, and the outputs compared
                    problem.run(fn, 0, args.threads)
                    outs.append(problem.out.clone())
                if not all(torch.equal(outs[0], o) for o in outs[1:]):
                    diff = max((outs[0].float() - o.float()).abs().max().item() for o in outs[1:])
                    print(f"  note: outputs differ from the baseline's (max abs diff {diff:.3g})")
                per_call = problem.kv_bytes / 1e9 / batch_gbps(problem, lib, args.threads, 3, placement == "dram")[0]
                calls = max(len(problem.caches), int(args.min_seconds / per_call) + 1)
                rates = {n: [] for n in libs}
                best = {n: 0.0 for n in libs}
                for _ in range(args.repeats):
                    for n, fn in libs.items():
                        rate, fastest = batch_gbps(problem, fn, args.threads, calls, placement == "dram")
                        rates[n].append(rate)
                        best[n] = max(best[n], fastest)
                cells = [f"{statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) / {best[n]:.1f}"
                         for n, r in rates.items()]
                row = f"| {shape.name} | {dtype_name} | {placement} | {problem.kv_bytes / 1e6:.1f} | " + " | ".join(cells)
                if args.baseline:
                    med = [statistics.median(r) for r in rates.values()]
                    tops = list(best.values())
                    row += f" | {med[-1] / med[0]:.2f}x / {tops[-1] / tops[0]:.2f}x"
                print(row + " |", flush=True)
                del problem


if __name__ == "__main__":
    main()
