/* Shared scalar helpers of mmkit's CPU kernels: bfloat16 conversions and a vectorizable exp. */
#ifndef MMKIT_BF16_H
#define MMKIT_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 cast; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x) written so that loops over it vectorize (libm's expf is a scalar call): x is clamped
 * to [-87, 88], reduced as x = n ln2 + r with |r| <= ln2/2, and a degree-6 Taylor polynomial on
 * r is scaled by 2^n through the exponent bits. Relative error about 2.5e-7 (checked against
 * double exp over every float in [-87, 0]), like torch's own vectorized exp. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln2) by adding 1.5 * 2^23 (plain float adds vectorize; roundf does not
     * without -ffast-math); the low mantissa bits of the sum then hold n itself. */
    const float shifted = x * 1.44269504088896341f + 12582912.0f;
    int32_t n_bits;
    memcpy(&n_bits, &shifted, sizeof n_bits);
    const int32_t n_int = n_bits - 0x4B400000;
    const float n = shifted - 12582912.0f;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float poly = 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &poly, sizeof bits);
    bits += n_int * (1 << 23); /* n in [-126, 127]: the exponent stays normal */
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One element of SiLU(gate) * up, for the elementwise kernels (elementwise_cpu.c,
 * elementwise_f32_cpu.c), whose row functions the gate/up GEMM's fused epilogue calls too.
 * bf16 follows transformers' rounding: silu(gate) is a bf16 tensor before the product. */
static inline uint16_t silu_mul_bf16_elem(uint16_t gate, uint16_t up) {
    const float x = bf16_to_f32(gate);
    const float act = round_bf16(x / (1.0f + exp_clamped(-x)));
    return f32_to_bf16(act * bf16_to_f32(up));
}

static inline float silu_mul_f32_elem(float gate, float up) { return (gate / (1.0f + exp_clamped(-gate))) * up; }

/* exp_clamped in vectors of one width: the same clamp, fused multiply-adds and exponent bits
 * (gcc fuses the scalar one's multiply-adds likewise), so each lane equals exp_clamped's result.
 * MMKIT_DEFINE_EXP_VEC(exp512, __m512, __m512i, _mm512, si512) defines __m512 exp512(__m512);
 * expand it where that width's intrinsics (immintrin.h) are enabled. */
#define MMKIT_DEFINE_EXP_VEC(NAME, VT, VI, P, SI)                                                                  \
    static inline VT NAME(VT x) {                                                                                  \
        x = P##_max_ps(P##_min_ps(x, P##_set1_ps(88.0f)), P##_set1_ps(-87.0f));                                    \
        const VT shifted = P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(12582912.0f));           \
        const VI n_int = P##_sub_epi32(P##_castps_##SI(shifted), P##_set1_epi32(0x4B400000));                      \
        const VT n = P##_sub_ps(shifted, P##_set1_ps(12582912.0f));                                                \
        VT r = P##_fnmadd_ps(n, P##_set1_ps(0.693145751953125f), x);                                               \
        r = P##_fnmadd_ps(n, P##_set1_ps(1.428606765330187e-06f), r);                                              \
        VT poly = P##_set1_ps(1.0f / 720.0f);                                                                      \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.0f / 120.0f));                                                  \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.0f / 24.0f));                                                   \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.0f / 6.0f));                                                    \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(0.5f));                                                           \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.0f));                                                           \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.0f));                                                           \
        return P##_cast##SI##_ps(P##_add_epi32(P##_castps_##SI(poly), P##_slli_epi32(n_int, 23)));               \
    }

#endif
