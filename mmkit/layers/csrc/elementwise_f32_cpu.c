/* Fused float32 elementwise kernels for CPU: residual add + RMSNorm, rotary embedding in place,
 * SiLU(gate) * up: the float32 twins of elementwise_cpu.c's bf16 kernels. In float32 each
 * replaces 3-7 torch ops (each a pass over memory and a dispatch; the rotary's roll alone is a
 * cat of two slices), which at 128 decode rows were a third of a step.
 *
 * Rounding: every product and sum that transformers rounds is rounded here in the same order
 * (no fused multiply-adds: fp-contract is off for this file), so the rotary embedding and the
 * residual add are bit-identical to torch. Two things are computed differently and can land one
 * float32 ulp apart: the order of the sum of squares in RMSNorm, and exp in SiLU (exp_clamped,
 * about 2.5e-7 relative, like torch's own vectorized exp). Greedy ids still equal transformers'
 * in every parity test; MMKIT_FUSED_F32=0 keeps the torch ops (norms.py, rotary.py, llama.py). */
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#ifndef MMKIT_PARALLEL_MIN_ELEMENTS
#define MMKIT_PARALLEL_MIN_ELEMENTS (1 << 18)
#endif

/* out = weight * (h * rsqrt(mean(h^2) + eps)), h = x, or with `add_residual` h = x + residual
 * stored into x (the new residual stream; `residual` is only read). All [num_tokens, hidden]. */
void mmkit_rms_norm_f32(float *out, float *x, const float *residual, const float *weight, int64_t num_tokens,
                        int64_t hidden, float eps, int add_residual, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * hidden >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *xr = x + t * hidden;
        const float *rr = residual + t * hidden;
        float *orow = out + t * hidden;
        float sq = 0.0f;
        if (add_residual) {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) {
                const float h = xr[i] + rr[i];
                xr[i] = h;
                sq += h * h;
            }
        } else {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) sq += xr[i] * xr[i];
        }
        const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) orow[i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotary embedding in place on the first `num_heads` heads of each token row of x:
 * x * cos + roll(x, half) * signed_sin (rotary.py's tables, float32 [max_positions, head_dim]). */
void mmkit_rotary_f32(float *x, const int64_t *positions, const float *cos, const float *signed_sin,
                      int64_t num_tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * num_heads * head_dim >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * head_dim;
        const float *s = signed_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = v[i], hi = v[half + i];
                const float a = lo * c[i] + hi * s[i];
                const float b = hi * c[half + i] + lo * s[half + i];
                v[i] = a;
                v[half + i] = b;
            }
        }
    }
}

/* out[t] = silu(gate) * up, gate = gate_up[t, :inter], up = gate_up[t, inter:];
 * silu(g) = g / (1 + exp(-g)) as torch computes it. */
void mmkit_silu_mul_f32(float *out, const float *gate_up, int64_t num_tokens, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * inter >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = gate_up + t * 2 * inter;
        const float *u = g + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = silu_mul_f32_elem(g[i], u[i]);
    }
}

/* One row of mmkit_silu_mul_f32 from separate gate and up arrays. The gate/up GEMM's fused
 * epilogue (linear_panels_cpu.c) calls it so that its SiLU is compiled here, with this file's
 * rounding (fp-contract off): its output is the same bits as the unfused pass. */
void mmkit_silu_mul_f32_row(float *out, const float *gate, const float *up, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = silu_mul_f32_elem(gate[i], up[i]);
}
