/* Warming the next layer's K/V while the MLP's GEMMs compute (decode steps, issue 52).
 *
 * Why: decode attention reads each sequence's K/V blocks, scattered over the pool, from DRAM,
 * and two cores fetch scattered 2 KiB blocks at only ~25 GB/s (a core's outstanding misses
 * bound it), against 70-80 GB/s when the same blocks sit in L3
 * (benchmarks/results/2026-12-07-decode-attention-dram/). The GEMMs before it are compute-bound
 * and leave the memory system idle. So the decode stack hands the gate/up GEMM the list of the
 * next layer's K and V blocks, and the GEMM's inner loop asks for a line or two of them per
 * step (PREFETCHT1: into L2, from which they fall to L3 as the GEMM's own data pushes them
 * out), a trickle its arithmetic hides. The next layer's attention then finds them in L3.
 * Measured (Zen 5, 2 threads, decode-heavy bf16 on the benchmark LLaVA, perf): attention's
 * share of the run 14.4% -> 7.7%, the gate/up GEMM's 32.6% -> 36.0% (the prefetch traffic costs
 * it); warming over gate/up and down both, decode steps 0.955x the time over 6 in-process pairs
 * (benchmarks/results/2026-12-07-round5d/kv_warm/). A line per inner step was worse than 4
 * lines every 4th step (one address computed), and PREFETCHT2 / NTA no better than T1. */
#ifndef MMKIT_KV_WARM_H
#define MMKIT_KV_WARM_H
#include <stdint.h>

/* The blocks to warm: block j is offsets[j / 2] bytes into the K cache (j even) or the V cache. */
typedef struct {
    const int64_t *offsets;
    int64_t num_offsets;
    const char *k_base, *v_base;
    int64_t block_lines; /* 64-byte lines per block */
} MmkitKvWarm;

#define MMKIT_WARM_EVERY 4

/* One thread's share of the blocks, walked line by line. */
typedef struct {
    const MmkitKvWarm *w;
    int64_t j, j_end, line, per_step;
} WarmCursor;

static inline WarmCursor warm_cursor(const MmkitKvWarm *w, int64_t t, int64_t nt, int64_t steps) {
    WarmCursor c = {w, 0, 0, 0, 0};
    if (!w) return c;
    const int64_t n = 2 * w->num_offsets;
    c.j = n * t / nt;
    c.j_end = n * (t + 1) / nt;
    const int64_t lines = (c.j_end - c.j) * w->block_lines;
    const int64_t calls = steps / MMKIT_WARM_EVERY;
    c.per_step = calls > 0 ? (lines + calls - 1) / calls : 0;
    if (c.per_step > 16) c.per_step = 16; /* more K/V than the GEMM can hide: warm what it can */
    return c;
}

/* The cursor's next lines, up to per_step of them within one block (one address computed):
 * called every MMKIT_WARM_EVERY inner-loop steps of the GEMM. */
static inline __attribute__((always_inline)) void warm_step(WarmCursor *c) {
    if (c->j >= c->j_end) return;
    const MmkitKvWarm *w = c->w;
    const char *at = ((c->j & 1) ? w->v_base : w->k_base) + w->offsets[c->j >> 1] + c->line * 64;
    const int64_t left = w->block_lines - c->line, n = c->per_step < left ? c->per_step : left;
    for (int64_t i = 0; i < n; ++i) __builtin_prefetch(at + i * 64, 0, 2); /* locality 2: PREFETCHT1 on x86 */
    c->line += n;
    if (c->line == w->block_lines) {
        c->line = 0;
        c->j++;
    }
}
#endif
