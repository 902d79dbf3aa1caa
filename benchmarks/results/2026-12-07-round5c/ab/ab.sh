#!/usr/bin/env bash
# Round 5c A/B (issue 52): engine decode throughput, mmkit alone (throughput.py --skip-hf),
# alternating runs in one session on one host, 3 pairs each:
#   silu_{bf16,f32}: BASE (main 8230f8f, the session's start: SiLU-mul as its own pass) against
#                    NEW (this tree: SiLU-mul in the gate/up GEMM's epilogue);
#   huge_bf16:       NEW with the KV cache committed at start-up (--kv-cache-preallocate, as
#                    peers.py runs mmkit) on 4 KiB pages (MMKIT_KV_HUGEPAGES=0) against the same
#                    cache advised huge pages (=1, what a preallocated cache now gets by default).
#   lazyhuge_bf16:   the same with the default lazy cache (pages committed as blocks are
#                    written, inside the timed run), to show why a lazy cache keeps 4 KiB pages.
# Usage, from the repository root: BASE_DIR=/tmp/base52 BASE_PY=/work/venvs/base52/bin/python \
#     bash benchmarks/results/2026-12-07-round5c/ab/ab.sh [silu_bf16 silu_f32 huge_bf16]
set -u
out=${OUT:-$(cd "$(dirname "$0")" && pwd)}  # OUT: another folder for the evidence
new_dir=$(pwd)
BASE_DIR=${BASE_DIR:-/tmp/base52}
BASE_PY=${BASE_PY:-/work/venvs/base52/bin/python}
lscpu | grep -E "Model name|CPU family|Model:|L2|L3|Flags" | cut -c1-200 > "$out/cpu.txt"
run() {  # run NAME DIR PY DTYPE [ENV...] (EXTRA: more throughput.py flags)
  local name=$1 dir=$2 py=$3 dtype=$4; shift 4
  (cd "$dir" && env OMP_WAIT_POLICY=PASSIVE "$@" timeout 900 "$py" benchmarks/throughput.py --workload decode-heavy \
      --dtype "$dtype" --threads 2 --repeats 1 --skip-hf --num-requests 64 --json "$out/$name.json" ${EXTRA:-}) \
      > "$out/$name.log" 2>&1
  echo "$name load $(cut -d' ' -f1 /proc/loadavg): $(grep -E 'mmkit:' "$out/$name.log" | head -1)"
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(silu_bf16 silu_f32 huge_bf16)
for stage in "${stages[@]}"; do
  for i in 1 2 3; do
    case $stage in
      silu_bf16) run "$stage-base-$i" "$BASE_DIR" "$BASE_PY" bfloat16; run "$stage-new-$i" "$new_dir" python bfloat16 ;;
      silu_f32) run "$stage-base-$i" "$BASE_DIR" "$BASE_PY" float32; run "$stage-new-$i" "$new_dir" python float32 ;;
      huge_bf16) EXTRA=--kv-cache-preallocate run "$stage-4k-$i" "$new_dir" python bfloat16 MMKIT_KV_HUGEPAGES=0
                 EXTRA=--kv-cache-preallocate run "$stage-2m-$i" "$new_dir" python bfloat16 MMKIT_KV_HUGEPAGES=1 ;;
      lazyhuge_bf16) run "$stage-4k-$i" "$new_dir" python bfloat16 MMKIT_KV_HUGEPAGES=0
                     run "$stage-2m-$i" "$new_dir" python bfloat16 MMKIT_KV_HUGEPAGES=1 ;;
      *) echo "unknown stage $stage"; exit 2 ;;
    esac
  done
done 2>&1 | tee -a "$out/ab.log"
