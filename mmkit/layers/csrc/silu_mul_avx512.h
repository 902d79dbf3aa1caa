/* SiLU(gate) * up on 16 bf16 lanes for AVX-512 builds, shared by the unfused pass
 * (elementwise_cpu.c) and the gate/up GEMM's fused epilogue (linear_panels_cpu.c), so the two
 * give the same bits. Each lane equals bf16.h's scalar silu_mul_bf16_elem: the exp is
 * exp_clamped's vector twin (MMKIT_DEFINE_EXP_VEC), and the add, the division, the product and
 * the roundings are exact IEEE operations with nothing left for the compiler to contract.
 * Written with intrinsics because gcc's vectorization of the scalar element if-converted
 * f32_to_bf16's NaN branch into seven masked divisions per 32 elements: 8% of a decode-heavy
 * bf16 run sat on them (perf, Zen 5, 2026-12-07); the vector pass is 2.4x as fast. */
#ifndef MMKIT_SILU_MUL_AVX512_H
#define MMKIT_SILU_MUL_AVX512_H
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "bf16.h"

MMKIT_DEFINE_EXP_VEC(silu_exp512, __m512, __m512i, _mm512, si512)

/* f32_to_bf16 on 16 lanes (round to nearest even, NaN kept quiet), in the low half of each. */
static inline __m512i f32_to_bf16_512(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __m512 bf16x16_to_f32(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* 16 lanes of silu_mul_bf16_elem(gate, up). */
static inline __m256i silu_mul_bf16_16(__m256i gate, __m256i up) {
    const __m512 x = bf16x16_to_f32(gate);
    const __m512 e = silu_exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512i act = f32_to_bf16_512(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    const __m512 upf = bf16x16_to_f32(up);
    return _mm512_cvtepi32_epi16(f32_to_bf16_512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(act, 16)), upf)));
}
#endif
#endif
