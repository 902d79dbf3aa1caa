/* Weight-only int8 / int4 GEMM for small batches (GEMV at batch 1) in mmkit's quantized linears.
 *
 * out[m, n] = sum_k x[m, k] * w'[n, k],  w'[n, k] = (q[n, k] - z[n, g]) * s[n, g],  g = k / gs.
 * x is bf16 or float32; out has x's dtype. Decode reads the weights once per step, so what
 * matters is how few instructions decode each byte of them (the bytes themselves are 1/2 or
 * 1/4 of bf16's). Up to MMKIT_QROWS rows of x share one decoded weight row.
 *
 * Weight layouts (built by mmkit/layers/quant_pack.py):
 *   bits 8: q int8 [N, K], zeros int8 [N, G] or NULL (symmetric).
 *   bits 4: q uint8 [N, K / 2]; in each block of 32 columns, byte j holds column j in its low
 *           nibble and column j + 16 in its high nibble; zeros uint8 [N, G] (always: a
 *           symmetric checkpoint's values are stored offset by 8).
 *
 * AVX-512 paths (gs a multiple of 32):
 *   int8: q -> float32 (exact), partial dot per group in float32, times s once per group.
 *   int4, float32 x: per group a 16-entry table T[u] = (u - z) * s (exactly w' as the float32
 *         round trip computes it) and one permute per 16 weights: no subtract or scale per
 *         weight, no per-group partial sums.
 *   int4, bf16 x (AVX512-BF16, K % 64 == 0): nibbles -> bf16 integers through one permute per
 *         32 weights, VDPBF16PS (32 products per instruction) against x, then per group
 *         s * (sum x u - z * sum x), with sum x per group computed once per call. The result
 *         is rounded to bf16, so the float32 reassociation is far below the output's rounding.
 * The portable path (other group sizes, or a build without AVX-512: MMKIT_KERNEL_GENERIC=1)
 * computes (q - z) * x per group, then times s. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MMKIT_Q_AVX512 1
#endif

#define MMKIT_QROWS 4
#define MMKIT_Q_PF_ROWS 8
#define MMKIT_INLINE static inline __attribute__((always_inline))

/* Portable: rows of x (float32, row stride K) against one weight row. */
static void qrow_portable(float *res, const float *x, int rows, int64_t K, const uint8_t *wrow, int bits,
                          const float *srow, const uint8_t *zrow, int64_t gs) {
    const int64_t G = K / gs;
    for (int r = 0; r < rows; ++r) {
        const float *xm = x + r * K;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
            float zf = 0.0f;
            if (zrow) zf = bits == 8 ? (float)((const int8_t *)zrow)[g] : (float)zrow[g];
            float part = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
                float w;
                if (bits == 8) {
                    w = (float)((const int8_t *)wrow)[k];
                } else {
                    const int64_t block = k / 32, j = k % 32;
                    const uint8_t byte = wrow[block * 16 + (j & 15)];
                    w = (float)(j < 16 ? (byte & 15) : (byte >> 4));
                }
                part += (w - zf) * xm[k];
            }
            acc += part * srow[g];
        }
        res[r] = acc;
    }
}

#ifdef MMKIT_Q_AVX512
/* int8, float32 x, R rows (a compile-time constant after inlining: accumulators in registers). */
MMKIT_INLINE void q8_rows(float *res, const float *x, const int R, int64_t K, const int8_t *wrow,
                          const float *srow, const int8_t *zrow, int64_t gs) {
    __m512 acc[MMKIT_QROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, ++g) {
        __m512 p0[MMKIT_QROWS], p1[MMKIT_QROWS];
        for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm512_setzero_ps();
        const __m512 zv = _mm512_set1_ps(zrow ? (float)zrow[g] : 0.0f);
        for (int64_t k = g0; k < g0 + gs; k += 32) {
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k))));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k + 16))));
            if (zrow) {
                w0 = _mm512_sub_ps(w0, zv);
                w1 = _mm512_sub_ps(w1, zv);
            }
            for (int r = 0; r < R; ++r) {
                p0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), p0[r]);
                p1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * K + k + 16), p1[r]);
            }
        }
        const __m512 sv = _mm512_set1_ps(srow[g]);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p0[r], p1[r]), sv, acc[r]);
    }
    for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(acc[r]);
}

/* int4, float32 x: table lookup of exact w' per group. */
MMKIT_INLINE void q4f_rows(float *res, const float *x, const int R, int64_t K, const uint8_t *wrow,
                           const float *srow, const uint8_t *zrow, int64_t gs) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low4 = _mm512_set1_epi32(15);
    __m512 a0[MMKIT_QROWS], a1[MMKIT_QROWS];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, ++g) {
        const __m512 table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps((float)zrow[g])),
                                           _mm512_set1_ps(srow[g]));
        for (int64_t k = g0; k < g0 + gs; k += 32) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k / 2)));
            const __m512 w0 = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), table);
            const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
            for (int r = 0; r < R; ++r) {
                a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), a0[r]);
                a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * K + k + 16), a1[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define MMKIT_Q_BF16DP 1
/* int4, bf16 x. xp: x rearranged per 64 columns as [c0-15, c32-47 | c16-31, c48-63] (the lane
 * order of one 32-byte weight load widened to 16 bits: low nibbles, then high nibbles);
 * xsum: [R, G] float32 sums of each group of x. */
MMKIT_INLINE void q4b_rows(float *res, const uint16_t *xp, const float *xsum, const int R, int64_t K, int64_t G,
                           const uint8_t *wrow, const float *srow, const uint8_t *zrow, int64_t gs) {
    /* bf16 of 0..15 (entries 16..31 repeat them: the indices are 4 bits). */
    static const uint16_t bf16_ints[32] = {
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_loadu_si512(bf16_ints);
    const __m512i low4 = _mm512_set1_epi16(15);
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[MMKIT_QROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wrow + k / 2)));
        const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low4), table);
        const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        /* lanes 0-7 of a product hold group k / gs, lanes 8-15 group (k + 32) / gs */
        const __m512 coef = gs == 32
            ? _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(srow + k / 32)))))
            : _mm512_set1_ps(srow[k / gs]);
        for (int r = 0; r < R; ++r) {
            const uint16_t *xr = xp + r * K + k;
            __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, (__m512bh)_mm512_loadu_si512(xr));
            part = _mm512_dpbf16_ps(part, wh, (__m512bh)_mm512_loadu_si512(xr + 32));
            acc[r] = _mm512_fmadd_ps(part, coef, acc[r]);
        }
    }
    /* minus sum_g s_g z_g xsum_g, 16 groups per step (masked tail) */
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mask = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
        const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, srow + g),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, zrow + g))));
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fnmadd_ps(sz, _mm512_maskz_loadu_ps(mask, xsum + r * G + g), acc[r]);
    }
    for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif
#endif

typedef struct {
    const float *xf;     /* [M, K] float32 x (all paths but q4b) */
    const uint16_t *xp;  /* [M, K] bf16 x in q4b's lane order */
    const float *xsum;   /* [M, G] */
    int path;            /* 0 portable, 1 q8, 2 q4f, 3 q4b */
} qinput;

/* One weight row n against rows [m0, m0 + rows) of x. */
static void qrow(float *res, const qinput *in, int64_t m0, int rows, int64_t K, int64_t G, const uint8_t *wrow,
                 int bits, const float *srow, const uint8_t *zrow, int64_t gs) {
    const float *x = in->xf ? in->xf + m0 * K : NULL;
    (void)G;
    switch (in->path) {
#ifdef MMKIT_Q_AVX512
#define MMKIT_Q_DISPATCH(call4, call3, call2, call1) \
    switch (rows) { case 4: call4; break; case 3: call3; break; case 2: call2; break; default: call1; } return;
    case 1:
        MMKIT_Q_DISPATCH(q8_rows(res, x, 4, K, (const int8_t *)wrow, srow, (const int8_t *)zrow, gs),
                         q8_rows(res, x, 3, K, (const int8_t *)wrow, srow, (const int8_t *)zrow, gs),
                         q8_rows(res, x, 2, K, (const int8_t *)wrow, srow, (const int8_t *)zrow, gs),
                         q8_rows(res, x, 1, K, (const int8_t *)wrow, srow, (const int8_t *)zrow, gs))
    case 2:
        MMKIT_Q_DISPATCH(q4f_rows(res, x, 4, K, wrow, srow, zrow, gs), q4f_rows(res, x, 3, K, wrow, srow, zrow, gs),
                         q4f_rows(res, x, 2, K, wrow, srow, zrow, gs), q4f_rows(res, x, 1, K, wrow, srow, zrow, gs))
#ifdef MMKIT_Q_BF16DP
    case 3: {
        const uint16_t *xp = in->xp + m0 * K;
        const float *xs = in->xsum + m0 * G;
        MMKIT_Q_DISPATCH(q4b_rows(res, xp, xs, 4, K, G, wrow, srow, zrow, gs),
                         q4b_rows(res, xp, xs, 3, K, G, wrow, srow, zrow, gs),
                         q4b_rows(res, xp, xs, 2, K, G, wrow, srow, zrow, gs),
                         q4b_rows(res, xp, xs, 1, K, G, wrow, srow, zrow, gs))
    }
#endif
#endif
    default:
        qrow_portable(res, x, rows, K, wrow, bits, srow, zrow, gs);
    }
}

static int choose_path(int bits, int dtype, int64_t K, int64_t gs, const void *zeros) {
#ifdef MMKIT_Q_AVX512
    if (gs % 32 != 0) return 0;
    if (bits == 8) return 1;
    if (zeros == NULL) return 0; /* int4 always has zero points (quant_pack.py) */
#ifdef MMKIT_Q_BF16DP
    if (dtype == 1 && K % 64 == 0 && (gs == 32 || gs % 64 == 0)) return 3;
#endif
    return 2;
#else
    (void)bits; (void)dtype; (void)K; (void)gs; (void)zeros;
    return 0;
#endif
}

/* x: [M, K] (dtype 0 float32, 1 bf16); out: [M, N] same dtype; w, scales [N, G] f32, zeros.
 * Returns 0, or 1 when scratch memory could not be allocated. */
int mmkit_quant_gemm(void *out, const void *x, int64_t M, int64_t K, int64_t N, int dtype, const void *w,
                     int bits, const float *scales, const void *zeros, int64_t gs, int nthreads) {
    const int64_t G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    qinput in = {NULL, NULL, NULL, choose_path(bits, dtype, K, gs, zeros)};
    void *scratch = NULL;
    if (in.path == 3) {
        /* bf16 x rearranged for q4b_rows, and its group sums (from the same bf16 values). */
        scratch = malloc((size_t)(M * K) * sizeof(uint16_t) + (size_t)(M * G) * sizeof(float));
        if (!scratch) return 1;
        uint16_t *xp = (uint16_t *)scratch;
        float *xsum = (float *)(xp + M * K);
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t m = 0; m < M; ++m) {
            const uint16_t *src = xb + m * K;
            uint16_t *dst = xp + m * K;
            for (int64_t c = 0; c < K; c += 64)
                for (int j = 0; j < 16; ++j) {
                    dst[c + j] = src[c + j];
                    dst[c + 16 + j] = src[c + 32 + j];
                    dst[c + 32 + j] = src[c + 16 + j];
                    dst[c + 48 + j] = src[c + 48 + j];
                }
            for (int64_t g = 0; g < G; ++g) {
                float s = 0.0f;
                for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += bf16_to_f32(src[k]);
                xsum[m * G + g] = s;
            }
        }
        in.xp = xp;
        in.xsum = xsum;
    } else if (dtype == 1) {
        float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return 1;
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(xb[i]);
        in.xf = xf;
        scratch = xf;
    } else {
        in.xf = (const float *)x;
    }
    if (nthreads < 1) nthreads = 1;
    if (N * K < 65536) nthreads = 1; /* waking a worker costs more than a small matrix */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wrow = (const uint8_t *)w + n * row_bytes;
#ifdef MMKIT_Q_AVX512
        /* Rows are short (K or K / 2 bytes: a few cache lines) and read one after another, too
         * short a stream for the hardware prefetcher to run ahead: ask for a row 8 ahead. */
        if (n + MMKIT_Q_PF_ROWS < N)
            for (int64_t b = 0; b < row_bytes; b += 64)
                _mm_prefetch((const char *)(wrow + MMKIT_Q_PF_ROWS * row_bytes + b), _MM_HINT_T0);
#endif
        const uint8_t *zrow = zeros ? (const uint8_t *)zeros + n * G : NULL;
        float res[MMKIT_QROWS];
        for (int64_t m0 = 0; m0 < M; m0 += MMKIT_QROWS) {
            const int rows = M - m0 < MMKIT_QROWS ? (int)(M - m0) : MMKIT_QROWS;
            qrow(res, &in, m0, rows, K, G, wrow, bits, scales + n * G, zrow, gs);
            for (int r = 0; r < rows; ++r) {
                if (dtype == 1) ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(res[r]);
                else ((float *)out)[(m0 + r) * N + n] = res[r];
            }
        }
    }
    free(scratch);
    return 0;
}
