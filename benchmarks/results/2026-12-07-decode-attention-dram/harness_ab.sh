#!/bin/sh
# The decode kernel alone (decode_attention_harness.c), "main" (the committed kernel before this
# change) and "new" (the checkout) built with the kernel's flags and run alternately: best and
# mean GB/s of N calls and a hash of the output (equal hashes: bit-identical outputs). 1 and 2
# threads, block sizes 16, 64, 128; "dram": 60 layers of caches (~500 MB) called in turn; "cache":
# one layer again and again. Run from the repository root:
#   sh benchmarks/results/2026-12-07-decode-attention-dram/harness_ab.sh > .../harness_ab.log
set -e
HERE=benchmarks/results/2026-12-07-decode-attention-dram
T=$(mktemp -d)
FLAGS="-O3 -march=native -fno-trapping-math -fopenmp -std=gnu11"
mkdir -p $T/main $T/new
for h in bf16.h paged_item_avx2.h paged_tile_avx2.h; do git show main:mmkit/layers/csrc/$h > $T/main/$h; cp mmkit/layers/csrc/$h $T/new/; done
git show main:mmkit/layers/csrc/paged_attention_cpu.c > $T/main/p.c
cp mmkit/layers/csrc/paged_attention_cpu.c $T/new/p.c
for d in main new; do gcc $FLAGS $HERE/decode_attention_harness.c $T/$d/p.c -o $T/$d/h -lm; done
lscpu | grep -E "Model name|CPU family|^Model:"
echo "main = $(git rev-parse --short main), new = checkout $(git rev-parse --short HEAD)"
uptime
export OMP_WAIT_POLICY=PASSIVE
for round in 1 2; do
  for th in 1 2; do
    for shape in "8 512 32 8" "32 512 9 3"; do
      for d in main new; do
        echo "round $round, threads $th, cache, bs 16, B CTX H KV = $shape, bf16, $d: $(T=$th $T/$d/h $shape 1 300 16)"
      done
      for bs in 16 64 128; do
        for d in main new; do
          echo "round $round, threads $th, dram, bs $bs, B CTX H KV = $shape, bf16, $d: $(T=$th LAYERS=60 $T/$d/h $shape 1 300 $bs)"
        done
      done
    done
  done
done
uptime
rm -rf $T
