#!/usr/bin/env bash
# Issue 45 A/B after items 1 and 4 (n > 1 fan-out, ModelCapabilities): decode-heavy throughput,
# base 137646d (this session's starting main, /tmp/base45, venv base45) vs the merged main
# (system python), alternating, 3 pairs, same machine, same run. mmkit alone (--skip-hf).
set -u
out=/work/main/benchmarks/results/2026-12-06-issue45-fanout-ab
mkdir -p $out
lscpu | grep -E "Model name|CPU family|Model:|Flags" | cut -c1-200 > $out/cpu.txt
for i in 1 2 3; do
  for side in base main; do
    if [ $side = base ]; then dir=/tmp/base45; py=/work/venvs/base45/bin/python; else dir=/work/main; py=python; fi
    (cd $dir && OMP_WAIT_POLICY=PASSIVE timeout 900 $py benchmarks/throughput.py --workload decode-heavy --dtype bfloat16 \
        --threads 2 --repeats 1 --skip-hf --num-requests 64 --json $out/$side-$i.json) > $out/$side-$i.log 2>&1
    grep -E "mmkit:" $out/$side-$i.log
  done
done
