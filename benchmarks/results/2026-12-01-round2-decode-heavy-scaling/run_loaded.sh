#!/bin/sh
# Round 2 measurements taken while the machine was shared (load average ~9 on 2 cores).
cd "$(dirname "$0")/../../.." || exit 1
export OMP_WAIT_POLICY=PASSIVE
R=benchmarks/results/2026-12-01-round2-decode-heavy-scaling
PY=.venv/bin/python
date -u > $R/loaded_times.txt
nice $PY benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 --num-requests 64 --repeats 3 --large-images --ab-async --json $R/async_ab_loaded.json > $R/async_ab_loaded.log 2>&1
date -u >> $R/loaded_times.txt
nice $PY benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 --num-requests 128 --repeats 3 --hf-batch-sizes 64,all --rss --json $R/decode_heavy_bf16_loaded.json > $R/decode_heavy_bf16_loaded.log 2>&1
date -u >> $R/loaded_times.txt
nice $PY benchmarks/scaling.py --dtype bfloat16 --num-layers 4 --max-requests 256 --rates 0.5,1,2,4 --load-requests 32 --out-dir $R/scaling_loaded > $R/scaling_loaded.log 2>&1
date -u >> $R/loaded_times.txt
