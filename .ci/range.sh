#!/usr/bin/env bash
# Both ends of the supported dependency range: the family parity tests (PARITY_TESTS in
# tests/dependency_range.py) in two fresh venvs, one at pyproject's floors and one at the newest
# torch / torchvision / transformers the package index offers. Each venv gets its own
# PIP_CONSTRAINT file, which also lifts a machine-wide pip cap on torch for that venv alone.
# Usage: .ci/range.sh [floor|newest]...   (default: both; the two installs download in parallel)
set -euo pipefail
cd "$(dirname "$0")/.."
ends=("$@"); [ ${#ends[@]} -eq 0 ] && ends=(floor newest)
base="${MMKIT_RANGE_DIR:-${TMPDIR:-/tmp}/mmkit-range}"
mkdir -p "$base"
install() {  # $1: floor|newest
  local dir="$base/$1" pins constraint="$base/$1-constraints.txt"
  pins=$(python tests/dependency_range.py "$1")   # one requirement per line
  if [ "$1" = floor ]; then printf '%s\n' $pins > "$constraint"; else : > "$constraint"; fi
  rm -rf "$dir" && python -m venv "$dir"
  PIP_CONSTRAINT="$constraint" "$dir/bin/pip" install -q --upgrade $pins
  PIP_CONSTRAINT="$constraint" "$dir/bin/pip" install -q -e ".[serve]" pytest pytest-timeout hypothesis av openai httpx
}
pids=()
for end in "${ends[@]}"; do
  install "$end" > "$base/$end-install.log" 2>&1 & pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "range: installing the ${ends[$i]} venv failed:" >&2; tail -20 "$base/${ends[$i]}-install.log" >&2; exit 1; }
done
for end in "${ends[@]}"; do
  py="$base/$end/bin/python"
  echo "== $end: $("$py" -c 'import torch, torchvision, transformers; print("torch", torch.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__)')"
  start=$(date +%s)
  # shellcheck disable=SC2046
  "$py" -m pytest -q -p no:cacheprovider $(python tests/dependency_range.py tests)
  echo "== $end: parity tests in $(( $(date +%s) - start )) s"
done
