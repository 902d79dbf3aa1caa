"""A/B of the AVX2 prefill tile (round 4n): the kernel sources before a change
(`git archive <commit> mmkit/layers/csrc | tar -x -C /tmp/oldsrc`) against the working tree, and
SDPA on the same chunk; one chunk of L new tokens over L keys (9 / 3 heads x 64, or 28 / 4 x 128
with --dim 128), alternating old / new / SDPA, median of --repeats calls each, ms. Outputs of old
and new are compared (bit for bit, and the largest difference).

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/results/2026-12-05-round4n-avx2-softmax/tile_ab.py [OLD_SRC] \
        [--lengths 256 512 768 1024 2048 4096] [--repeats 7] [--dim 64]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import common  # noqa: E402  (OpenMP environment before torch)
import prefill_attention  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mmkit.layers import cpu_kernels  # noqa: E402
from mmkit.layers.attention import PREFILL_TILE  # noqa: E402


def lib_from(src):
    cpu_kernels._SOURCE_DIR = Path(src)
    cpu_kernels._state.clear()
    return cpu_kernels.library()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old_src", nargs="?", default="/tmp/oldsrc/mmkit/layers/csrc")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 768, 1024, 2048, 4096])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    common.set_threads(2)
    if args.dim == 128:  # a 7B-like head layout
        prefill_attention.HEADS, prefill_attention.KV_HEADS, prefill_attention.DIM = 28, 4, 128
    old = lib_from(args.old_src)
    new = lib_from(ROOT / "mmkit/layers/csrc")
    assert old is not None and new is not None and old is not new
    print(f"avx512 build: {cpu_kernels.has_avx512()}, threads 2, PREFILL_TILE {PREFILL_TILE}, "
          f"heads {prefill_attention.HEADS}/{prefill_attention.KV_HEADS} x {prefill_attention.DIM}, "
          f"ms per call (median of {args.repeats})", flush=True)
    scale = prefill_attention.DIM ** -0.5
    for name in args.dtype:
        dtype = getattr(torch, name)
        for length in args.lengths:
            q, k_cache, v_cache, ids, blocks, lens, k, v = prefill_attention.problem(length, dtype)
            tiles = torch.tensor(list(range(0, length, PREFILL_TILE)) + [length])
            qs = q.transpose(0, 1)

            def paged(lib):
                cpu_kernels._state["lib"] = lib
                return cpu_kernels.paged_rows_attention(q, k_cache, v_cache, ids, blocks, lens, tiles, scale)

            ways = {"old": lambda: paged(old), "new": lambda: paged(new),
                    "sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)}
            with torch.inference_mode():
                a, b = paged(old), paged(new)
            same = torch.equal(a, b)
            diff = (a.float() - b.float()).abs().max().item()
            m = prefill_attention.median_ms(ways, args.repeats)
            print(f"{name:9s} L={length:5d}  old {m['old']:8.2f}  new {m['new']:8.2f}  sdpa {m['sdpa']:8.2f}"
                  f"  new/old {m['new'] / m['old']:.2f}  new/sdpa {m['new'] / m['sdpa']:.2f}"
                  f"  old/sdpa {m['old'] / m['sdpa']:.2f}  bit-identical {same} max|diff| {diff:.2g}", flush=True)


if __name__ == "__main__":
    main()
