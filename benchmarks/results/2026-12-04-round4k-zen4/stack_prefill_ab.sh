#!/usr/bin/env bash
# A/B of the C stack taking prefill steps: "before" is a worktree of the previous commit
# (decode-only steps in the stack), "after" this one; alternating, two runs each per workload.
#   bash stack_prefill_ab.sh BEFORE_TREE AFTER_TREE PYTHON
set -u
before=$1 after=$2 py=$3
for spec in "mixed float32 64" "mixed bfloat16 64" "decode-heavy bfloat16 128" "decode-heavy float32 128"; do
  set -- $spec
  for i in 1 2; do
    for side in before after; do
      tree=$before; [ $side = after ] && tree=$after
      echo "== $side $1 $2 run $i"
      (cd "$tree" && PYTHONPATH="$tree" OMP_WAIT_POLICY=PASSIVE "$py" benchmarks/step_split.py --workload "$1" \
         --dtype "$2" --num-requests "$3" --kv-cache-preallocate 2>&1 | grep -E "tok/s|decode-only|steps with prefill")
    done
  done
done
