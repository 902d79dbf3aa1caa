#!/bin/sh
# Round 3 final measurements (issues 16 and 18), one after another on the otherwise idle
# machine. Each step logs its start time and load average to times.txt.
cd "$(dirname "$0")/../../.." || exit 1
export OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000
R=benchmarks/results/2026-12-01-round3-idle-throughput-ray
PY=${PY:-python}
stamp() { echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg) $1" >> $R/times.txt; }
stamp start
$PY benchmarks/latency.py --dtype bfloat16 --batch1-requests 3 --output-len 32 --skip-load --json $R/latency_bf16.json > $R/latency_bf16.log 2>&1
stamp latency_bf16
$PY benchmarks/caption_photos.py --num-images 64 --repeats 3 --json $R/caption_photos.json > $R/caption_photos.log 2>&1
stamp caption_photos
$PY benchmarks/ray_eval.py assets/eval/quickstart.jsonl --concurrency 2 --repeat 1 10 --runs 3 --json $R/ray_eval.json > $R/ray_eval.log 2>&1
stamp ray_eval
$PY benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 --num-requests 128 --repeats 3 --hf-batch-sizes all --rss --json $R/decode_heavy_bf16.json > $R/decode_heavy_bf16.log 2>&1
stamp decode_heavy_bf16
$PY benchmarks/throughput.py --workload mixed --dtype bfloat16 --num-requests 128 --repeats 3 --hf-batch-sizes 64,all --rss --json $R/mixed_bf16.json > $R/mixed_bf16.log 2>&1
stamp mixed_bf16
$PY benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 --num-requests 64 --repeats 3 --large-images --ab-async --json $R/async_ab_large.json > $R/async_ab_large.log 2>&1
stamp async_ab_large
$PY benchmarks/throughput.py --workload decode-heavy --dtype float32 --num-requests 128 --repeats 3 --hf-batch-sizes all --json $R/decode_heavy_fp32.json > $R/decode_heavy_fp32.log 2>&1
stamp decode_heavy_fp32
$PY benchmarks/throughput.py --workload mixed --dtype float32 --num-requests 128 --repeats 3 --hf-batch-sizes 32,all --json $R/mixed_fp32.json > $R/mixed_fp32.log 2>&1
stamp mixed_fp32
