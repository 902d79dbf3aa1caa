"""A/B of the paged decode attention kernel (round 4m): the sources at 1b649b6 (before the AVX2
decode item; `git archive 1b649b6 mmkit/layers/csrc | tar -x -C /tmp/oldsrc`) against the working tree,
same inputs, alternating, median of 15 calls each; batches shaped as the benchmark model's decode."""
import os, statistics, sys, time, random
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
torch.set_num_threads(2)
from pathlib import Path
from mmkit.layers import cpu_kernels
from mmkit.layers.attention import build_decode_metadata  # noqa
def lib_from(src):
    cpu_kernels._SOURCE_DIR = Path(src); cpu_kernels._state.clear(); return cpu_kernels.library()
old = lib_from("/tmp/oldsrc/mmkit/layers/csrc"); new = lib_from("/work/main/mmkit/layers/csrc")
assert old is not None and new is not None and old is not new
def run(lib, q, kc, vc, ids, mb, lens):
    cpu_kernels._state["lib"] = lib
    return cpu_kernels.paged_decode_attention(q, kc, vc, ids, mb, lens, 0.125)
for dtype in (torch.float32, torch.bfloat16):
    for nseq, ctx in ((96, (60, 200)), (8, (200, 400)), (1, (1000, 1000))):
        random.seed(0); torch.manual_seed(0)
        bs, heads, kvh, d = 16, 9, 3, 64
        lens = [random.randint(*ctx) for _ in range(nseq)]
        mb = max((l + bs - 1) // bs for l in lens); nblocks = nseq * mb + 8
        perm = torch.randperm(nblocks)[: nseq * mb]
        ids = perm.to(torch.int64)
        kc = torch.randn(kvh, nblocks, bs, d).to(dtype); vc = torch.randn(kvh, nblocks, bs, d).to(dtype)
        q = torch.randn(nseq, heads, d).to(dtype)
        L = torch.tensor(lens, dtype=torch.int64)
        a = run(old, q, kc, vc, ids, mb, L); b = run(new, q, kc, vc, ids, mb, L)
        diff = (a.float() - b.float()).abs().max().item()
        ta, tb = [], []
        for _ in range(15):
            t0 = time.perf_counter(); run(old, q, kc, vc, ids, mb, L); t1 = time.perf_counter(); run(new, q, kc, vc, ids, mb, L); t2 = time.perf_counter()
            ta.append(t1 - t0); tb.append(t2 - t1)
        ma, mbm = statistics.median(ta), statistics.median(tb)
        print(f"{str(dtype):15s} {nseq:3d} seqs ctx {ctx}: old {1e3*ma:7.3f} ms  new {1e3*mbm:7.3f} ms  new/old {mbm/ma:.2f}  max|diff| {diff:.2g}", flush=True)
