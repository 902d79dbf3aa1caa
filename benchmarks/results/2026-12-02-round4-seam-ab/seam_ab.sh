#!/bin/sh
# Issue 23 (seam) before/after throughput: main before the seam round-4 changes (BEFORE_REF,
# a8cef41) against this branch, bf16, decode-heavy and mixed, mmkit only. One process per run,
# before and after alternating, 3 runs each; the summary takes the median of each side's runs
# and the per-pair after/before ratios. Run from anywhere; logs and JSON land next to this file.
# NOTE: the machine is shared (five engineers, 2 cores): only ratios of runs taken side by
# side mean anything.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
AFTER=$(cd "$HERE/../../.." && pwd)
# Where the logs, JSON and times go (OUT=benchmarks/results/2026-12-02-round4-idle-reruns for the idle rerun).
OUT=$(mkdir -p "${OUT:-$HERE}" && cd "${OUT:-$HERE}" && pwd)  # absolute: each run cds into its tree
BEFORE_REF=${BEFORE_REF:-a8cef41}
BEFORE=${BEFORE:-/tmp/seam_ab_before}
PY=${PY:-python}
export OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000
if [ ! -d "$BEFORE" ]; then
  mkdir -p "$BEFORE"
  git -C "$AFTER" archive "$BEFORE_REF" | tar -x -C "$BEFORE"
  # The package-dir mapping of pyproject.toml (mmkit.models = models/, mmkit.processors =
  # processors/) as links, so PYTHONPATH=$BEFORE imports that tree alone, not the editable one.
  ln -s ../models "$BEFORE/mmkit/models"
  ln -s ../processors "$BEFORE/mmkit/processors"
  mkdir -p "$AFTER/benchmarks/.cache"
  ln -s "$AFTER/benchmarks/.cache" "$BEFORE/benchmarks/.cache"  # the same benchmark checkpoints
fi
stamp() { echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg) $1" >> "$OUT/seam_ab_times.txt"; }
run() {  # side workload requests rep
  if [ "$1" = before ]; then DIR=$BEFORE; else DIR=$AFTER; fi
  (cd "$DIR" && PYTHONPATH="$DIR" nice -n 5 $PY benchmarks/throughput.py --workload "$2" --dtype bfloat16 \
     --num-requests "$3" --repeats 1 --skip-hf --threads 2 --json "$OUT/seam_ab_$2_$1_$4.json") \
     > "$OUT/seam_ab_$2_$1_$4.log" 2>&1
  stamp "$1 $2 $4"
}
stamp start
for rep in 0 1 2; do
  run before decode-heavy 32 $rep; run after decode-heavy 32 $rep
  run before mixed 16 $rep; run after mixed 16 $rep
done
$PY - "$OUT" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
here = Path(sys.argv[1])
summary = {}
for workload in ("decode-heavy", "mixed"):
    sides = {side: [json.loads((here / f"seam_ab_{workload}_{side}_{rep}.json").read_text())["mmkit_tok_s"]
                    for rep in range(3)] for side in ("before", "after")}
    pairs = [a / b for a, b in zip(sides["after"], sides["before"])]
    summary[workload] = {"before_tok_s": sides["before"], "after_tok_s": sides["after"],
                         "before_median": statistics.median(sides["before"]),
                         "after_median": statistics.median(sides["after"]),
                         "after_over_before_per_pair": pairs, "median_pair_ratio": statistics.median(pairs)}
    print(f"{workload:12s} before {summary[workload]['before_median']:7.1f} tok/s  after "
          f"{summary[workload]['after_median']:7.1f} tok/s  after/before per pair "
          f"{', '.join(f'{r:.3f}' for r in pairs)} (median {summary[workload]['median_pair_ratio']:.3f})")
(here / "seam_ab.json").write_text(json.dumps(summary, indent=2) + "\n")
PYEOF
stamp done
