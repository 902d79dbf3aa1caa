#!/usr/bin/env bash
# The first GPU loan, turned into evidence: one script, offline, under 10 minutes.
#
#   benchmarks/gpu/check.sh [--out DIR] [--dry-run] [--skip-tests] [--only-shape SHAPE]
#
# Steps (each one's log in DIR/<step>.log, its status in DIR/steps.jsonl):
#   env        torch / transformers / triton versions, the GPU (nvidia-smi)
#   install    pip install --no-deps --no-build-isolation --no-index -e .  (over the image's
#              torch and transformers; nothing is fetched)
#   import     `import mmkit; mmkit.LLM` loads no server or Ray package
#   cuda_tests pytest -m cuda (float32 parity with TF32 off, FlexAttention compiled, graphs, ...);
#              tests whose package the image lacks skip with a reason
#   e2e_llava  7B-shaped random LLaVA-1.5: decode-heavy and batch 1 vs transformers' best static
#              batch, decode-step bandwidth vs the HBM roofline, kernel profile
#   e2e_qwen   the same for a Qwen2-VL-7B shape
#   summary    DIR/summary.json with the issue's goals checked
#
# --dry-run: every step on CPU, the CUDA ones replaced by their CPU stand-ins (pip --dry-run,
# `pytest -m cuda --collect-only`, tiny shapes on the flex backend with the graph buffers);
# tests/gpu/test_check_script.py runs it.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="benchmarks/results/gpu/$(date -u +%Y-%m-%d-%H%M)"
DRY=0
SKIP_TESTS=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    --only-shape) ONLY="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
export PY="${PYTHON:-python}" DRY
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
FAILED=0

# step NAME TIMEOUT_S CMD...: run, log, record {"step", "rc", "seconds"}.
step() {
  local name="$1" limit="$2"; shift 2
  local start rc
  start=$(date +%s)
  echo "== $name: $*"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout runs programs only
    timeout "$limit" bash -c "$(declare -f "$1"); $(printf '%q ' "$@")" > "$OUT/$name.log" 2>&1
  else
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  local took=$(( $(date +%s) - start ))
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $took, \"dry_run\": $DRY}" >> "$OUT/steps.jsonl"
  tail -n 5 "$OUT/$name.log"
  echo "== $name: rc=$rc in ${took}s"
  [ "$rc" -eq 0 ] || FAILED=1
  return 0
}

env_report() {
  "$PY" - <<'EOF'
import importlib.util, json, platform, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
for pkg in ("triton", "flashinfer", "flash_attn", "xgrammar", "fastapi", "ray"):
    info[pkg] = importlib.util.find_spec(pkg) is not None
print(json.dumps(info, indent=2))
EOF
  if [ "$DRY" -eq 0 ]; then nvidia-smi; else lscpu | grep -m1 'Model name' || true; fi
}

import_check() {
  "$PY" -c "
import sys, mmkit
mmkit.LLM
heavy = [m for m in ('fastapi', 'uvicorn', 'ray', 'xgrammar') if m in sys.modules]
assert not heavy, f'import mmkit loaded {heavy}'
print('import mmkit: ok')"
}

step env 60 env_report
"$PY" - "$OUT/env.log" "$OUT/env.json" <<'EOF' || true
import json, sys
text = open(sys.argv[1]).read()
start, end = text.find("{"), text.find("}") + 1
open(sys.argv[2], "w").write(text[start:end])
EOF

if [ "$DRY" -eq 1 ]; then
  step install 300 "$PY" -m pip install --dry-run --no-deps --no-build-isolation --no-index -e .
else
  step install 300 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
fi
step import 120 import_check

if [ "$SKIP_TESTS" -eq 0 ]; then
  if [ "$DRY" -eq 1 ]; then
    step cuda_tests 300 "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider tests
  else
    step cuda_tests 240 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml="$OUT/cuda_tests.xml" tests
  fi
fi

if [ "$DRY" -eq 1 ]; then
  E2E=(--device cpu --num-requests 3 --max-tokens 4 --hf-batch-sizes 1,3 --profile-tokens 2 --num-kv-blocks 24)
  LLAVA=(tiny-llava --attention-backend flex --stand-in-graphs)
  QWEN=(tiny-qwen2-vl)
  LIMIT=300
else
  E2E=(--device cuda --num-requests 64 --max-tokens 128 --hf-batch-sizes 1,8,32,64)
  LLAVA=(llava-7b)
  QWEN=(qwen2-vl-7b)
  LIMIT=240
fi
if [ -z "$ONLY" ] || [ "$ONLY" = "${LLAVA[0]}" ]; then
  step e2e_llava "$LIMIT" "$PY" benchmarks/gpu/e2e.py --out "$OUT" "${E2E[@]}" --shape "${LLAVA[@]}"
fi
if [ -z "$ONLY" ] || [ "$ONLY" = "${QWEN[0]}" ]; then
  step e2e_qwen "$LIMIT" "$PY" benchmarks/gpu/e2e.py --out "$OUT" "${E2E[@]}" --shape "${QWEN[@]}"
fi
step summary 60 "$PY" benchmarks/gpu/e2e.py --summarize "$OUT"
echo "check.sh: results in $OUT (failed steps: $FAILED)"
exit "$FAILED"
