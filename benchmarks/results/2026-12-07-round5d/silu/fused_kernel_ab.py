import sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import common
import torch
from mmkit.layers import linear_panels, cpu_kernels
torch.set_num_threads(2)
dtype = torch.bfloat16
for inter, k in [(1536, 576)]:
    ws = [(0.02 * torch.randn(2 * inter, k)).to(dtype) for _ in range(6)]
    pk = [linear_panels.pack(w) for w in ws]
    fus = [linear_panels.bind_silu_mul(p, inter, None) for p in pk]
    for m in (1, 8, 64, 128, 512):
        x = torch.randn(m, k).to(dtype)
        one = lambda: [f(x) for f in fus]
        b = []
        one()
        for _ in range(9):
            t0 = time.perf_counter(); one(); b.append(time.perf_counter() - t0)
        print(f"inter {inter} K {k} M={m:4d} fused {1e3*statistics.median(b):7.3f} ms", flush=True)
