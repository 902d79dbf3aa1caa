#!/bin/sh
# The decode kernel alone (decode_attention_harness.c), one thread, each version alternating,
# best and mean of N calls: "base" c44e72c (before this round), "pv" af3ef75 (P V for a group of
# heads at once), "pf" b6cb24b (pv + prefetching 4 blocks / chunks ahead), "head" the checkout
# (pf + the bf16 scores of up to 4 heads per K row load), and the two K-pass variants tried and
# not kept (*_tried.patch, applied to af3ef75). Run from the
# repository root:
#   sh benchmarks/results/2026-12-06-decode-attention/harness_ab.sh > harness_ab.log
set -e
HERE=benchmarks/results/2026-12-06-decode-attention
T=$(mktemp -d)
FLAGS="-O3 -march=native -fno-trapping-math -fopenmp -std=gnu11"
for d in base pv pf head kpair ktrans; do
  mkdir -p $T/$d
  for h in bf16.h paged_item_avx2.h paged_tile_avx2.h; do cp mmkit/layers/csrc/$h $T/$d/; done
done
git show c44e72c:mmkit/layers/csrc/paged_attention_cpu.c > $T/base/p.c
git show af3ef75:mmkit/layers/csrc/paged_attention_cpu.c > $T/pv/p.c
git show b6cb24b:mmkit/layers/csrc/paged_attention_cpu.c > $T/pf/p.c
cp mmkit/layers/csrc/paged_attention_cpu.c $T/head/p.c
cp $T/pv/p.c $T/kpair/p.c && patch -s $T/kpair/p.c $HERE/k_paired_unpack_tried.patch
cp $T/pv/p.c $T/ktrans/p.c && patch -s $T/ktrans/p.c $HERE/k_transposed_tried.patch
for d in base pv pf head kpair ktrans; do gcc $FLAGS $HERE/decode_attention_harness.c $T/$d/p.c -o $T/$d/h -lm; done
lscpu | grep -E "Model name|CPU family|^Model:"
uptime
for round in 1 2 3; do
  for shape in "8 512 32 8" "32 512 9 3"; do
    for dt in 1 0; do
      for d in base pv pf head kpair ktrans; do
        [ $dt = 0 ] && [ $d != base ] && [ $d != head ] && continue
        echo "round $round, hot, B CTX H KV = $shape, dtype $dt, $d: $($T/$d/h $shape $dt 300)"
      done
    done
    for d in base pv pf head; do
      echo "round $round, DRAM (40 layers), B CTX H KV = $shape, bf16, $d: $(LAYERS=40 $T/$d/h $shape 1 400)"
    done
  done
done
uptime
rm -rf $T
