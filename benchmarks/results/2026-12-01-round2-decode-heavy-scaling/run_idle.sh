#!/bin/sh
# Round 2 final measurements, run after the other helpers stopped (03:50 UTC).
cd "$(dirname "$0")/../../.." || exit 1
export OMP_WAIT_POLICY=PASSIVE
R=benchmarks/results/2026-12-01-round2-decode-heavy-scaling
PY=.venv/bin/python
date -u > $R/idle_times.txt; uptime >> $R/idle_times.txt
nice $PY benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 --num-requests 128 --repeats 3 --hf-batch-sizes all --rss --json $R/decode_heavy_bf16_idle.json > $R/decode_heavy_bf16_idle.log 2>&1
date -u >> $R/idle_times.txt; uptime >> $R/idle_times.txt
nice $PY benchmarks/latency.py --dtype bfloat16 --batch1-requests 3 --output-len 32 --skip-load --json $R/latency_bf16_idle.json > $R/latency_bf16_idle.log 2>&1
date -u >> $R/idle_times.txt; uptime >> $R/idle_times.txt
nice $PY benchmarks/scaling.py --dtype bfloat16 --num-layers 4 --max-requests 256 --rates 0.5,1,2,4 --load-requests 32 --out-dir $R/scaling_idle > $R/scaling_idle.log 2>&1
date -u >> $R/idle_times.txt; uptime >> $R/idle_times.txt
