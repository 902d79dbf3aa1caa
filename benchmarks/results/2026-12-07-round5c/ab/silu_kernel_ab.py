import sys, time, statistics
sys.path.insert(0, "/work/main/benchmarks")
import common
import torch
from mmkit.layers import linear_panels, cpu_kernels, fused_f32
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
for dtype in (torch.bfloat16, torch.float32):
  for inter, k in [(1536, 576), (8960, 1536)]:
    ws = [(0.02 * torch.randn(2 * inter, k)).to(dtype) for _ in range(6)]
    pk = [linear_panels.pack(w) for w in ws]
    runs = [linear_panels.bind(p, 2 * inter, None) for p in pk]
    fus = [linear_panels.bind_silu_mul(p, inter, None) for p in pk]
    sm = cpu_kernels.silu_mul_bf16 if dtype == torch.bfloat16 else fused_f32.silu_mul
    for m in (1, 8, 32, 64, 128, 512):
        x = torch.randn(m, k).to(dtype)
        two = lambda: [sm(r(x)) for r in runs]
        one = lambda: [f(x) for f in fus]
        a, b = [], []
        two(); one()
        for _ in range(7):
            t0 = time.perf_counter(); two(); a.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); one(); b.append(time.perf_counter() - t0)
        print(f"{str(dtype):15s} inter {inter} K {k} M={m:4d} two passes {1e3*statistics.median(a):7.3f} ms  fused {1e3*statistics.median(b):7.3f} ms  fused/two {statistics.median(b)/statistics.median(a):.2f}", flush=True)
