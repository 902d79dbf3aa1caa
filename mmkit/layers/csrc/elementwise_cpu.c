/* Fused bfloat16 elementwise kernels for CPU: residual add + RMSNorm, rotary embedding in
 * place, SiLU(gate) * up. Each replaces 4-8 torch ops (each a full pass over memory with a
 * bf16 <-> float conversion) by one pass.
 *
 * Rounding follows transformers' bf16 arithmetic step by step: every intermediate that HF
 * materializes as a bf16 tensor is rounded to bf16 here too (round to nearest even), and what
 * HF computes in float32 is computed in float32. What can differ: the order of the RMSNorm sum
 * and the exp in SiLU (both within float32 rounding), so an element can land one bf16 ulp
 * apart. Float32 models keep the torch ops (bit-identical to transformers).
 */
#if defined(__x86_64__) && defined(__AVX512F__)
/* gcc picks 256-bit vectors by default even where AVX-512 exists; these streaming loops run
 * about 20% faster with 512-bit ones (measured; the attention kernel does not, so this is
 * per file). Set before bf16.h so its helpers get the same target and still inline. */
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "silu_mul_avx512.h"

/* Below this many elements a kernel runs on the calling thread: waking OpenMP's sleeping
 * workers (OMP_WAIT_POLICY=PASSIVE) costs tens of microseconds, more than the work of a
 * decode step's rows (torch's own parallel_for has the same kind of grain size). */
#ifndef MMKIT_PARALLEL_MIN_ELEMENTS
#define MMKIT_PARALLEL_MIN_ELEMENTS (1 << 18)
#endif

/* out = weight * bf16(normalize(h)), with h = x, or, when `add_residual`, h = bf16(x + residual)
 * written back into x (x is then the decoder's new residual stream; `residual` is only read,
 * so it may alias anything, e.g. cached embeddings). All [num_tokens, hidden]. */
void mmkit_rms_norm_bf16(uint16_t *out, uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                         int64_t num_tokens, int64_t hidden, float eps, int add_residual, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * hidden >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        uint16_t *xr = x + t * hidden;
        const uint16_t *rr = residual + t * hidden;
        uint16_t *orow = out + t * hidden;
        float sq = 0.0f;
        if (add_residual) {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
                xr[i] = s;
                const float h = bf16_to_f32(s);
                sq += h * h;
            }
        } else {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) {
                const float h = bf16_to_f32(xr[i]);
                sq += h * h;
            }
        }
        const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) {
            const float normed = round_bf16(bf16_to_f32(xr[i]) * inv);
            orow[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
}

/* Rotary embedding in place on the first `num_heads` heads of each token row of `x`
 * (q and k are adjacent heads of the fused qkv output): x*cos + roll(x, half)*signed_sin with
 * cos/sin rounded to bf16 first and each product and the sum rounded, as HF's bf16 ops.
 * cos, signed_sin: float32 [max_positions, head_dim] (rotary.py's tables). */
void mmkit_rotary_bf16(uint16_t *x, const int64_t *positions, const float *cos, const float *signed_sin,
                       int64_t num_tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                       int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * num_heads * head_dim >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * head_dim;
        const float *s = signed_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *v = x + t * row_stride + h * head_dim;
            float lo[half], hi[half];
            for (int64_t i = 0; i < half; i++) {
                lo[i] = bf16_to_f32(v[i]);
                hi[i] = bf16_to_f32(v[half + i]);
            }
            /* roll by half: element i takes element i + half (first half) or i - half. */
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = round_bf16(lo[i] * round_bf16(c[i])) + round_bf16(hi[i] * round_bf16(s[i]));
                const float b = round_bf16(hi[i] * round_bf16(c[half + i])) +
                                round_bf16(lo[i] * round_bf16(s[half + i]));
                v[i] = f32_to_bf16(a);
                v[half + i] = f32_to_bf16(b);
            }
        }
    }
}

/* out[i] = silu_mul_bf16_elem(gate[i], up[i]) for i < n. */
static inline void silu_mul_bf16_run(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), silu_mul_bf16_16(_mm256_loadu_si256((const __m256i *)(gate + i)),
                                                                  _mm256_loadu_si256((const __m256i *)(up + i))));
#endif
    for (; i < n; i++) out[i] = silu_mul_bf16_elem(gate[i], up[i]);
}

/* out[t] = bf16(silu(gate)) * up, gate = gate_up[t, :inter], up = gate_up[t, inter:]. */
void mmkit_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t num_tokens, int64_t inter,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * inter >= MMKIT_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *g = gate_up + t * 2 * inter;
        const uint16_t *u = g + inter;
        uint16_t *o = out + t * inter;
        silu_mul_bf16_run(o, g, u, inter);
    }
}

