"""The decoder linear shapes of the benchmark LLaVA (fused qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536), 6 distinct copies so the weights come from memory: mmkit's panel GEMM
against torch's F.linear (oneDNN bf16 / MKL float32), per row count, median of 5 passes.

    OMP_WAIT_POLICY=PASSIVE T=2 python benchmarks/panel_gemm.py [1,4,16,128,512]
"""
import os, sys, time, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch, torch.nn.functional as F
torch.set_num_threads(int(os.environ.get("T", "2")))
from mmkit.layers import linear_panels as lp
print("panels available", lp.available())
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
L = 6
rows_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 128, 512]
for dtype in (torch.bfloat16, torch.float32):
    ws = [[torch.randn(n, k).mul(0.02).to(dtype) for (n, k) in shapes] for _ in range(L)]
    packed = [[lp.pack(w) for w in layer] for layer in ws]
    runs = [[lp.bind(p, w.shape[0], None) for p, w in zip(pl, wl)] for pl, wl in zip(packed, ws)]
    for M in rows_list:
        xs = {k: torch.randn(M, k).to(dtype) for (_, k) in shapes}
        def t(fn, reps=5):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e3
        def pan():
            for layer in runs:
                for r, (n, k) in zip(layer, shapes):
                    r(xs[k])
        def ref():
            for layer in ws:
                for w, (n, k) in zip(layer, shapes):
                    F.linear(xs[k], w)
        # check
        err = max((runs[0][i](xs[k]).float() - F.linear(xs[k].float(), ws[0][i].float())).abs().max().item() for i, (n, k) in enumerate(shapes))
        a, b = t(pan), t(ref)
        flops = 2 * M * sum(n * k for n, k in shapes) * L
        print(f"{str(dtype):15s} M={M:4d} panels {a:8.2f} ms ({flops/a/1e6:6.1f} GFLOPS)  F.linear {b:8.2f} ms ({flops/b/1e6:6.1f})  ratio {a/b:.2f}  maxerr {err:.3g}", flush=True)
