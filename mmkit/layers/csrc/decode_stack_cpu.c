/* A whole Llama-block decoder stack for one step, in one call from Python: a decode-only step,
 * or a step with prefill chunks whose rows the paged rows kernel attends (global layers).
 *
 * Why: at batch 1 every kernel of a decode step is small (a 576-wide RMSNorm is well under a
 * microsecond of arithmetic), yet each one cost 7-16 us through ctypes and the torch tensors
 * around it, about ten per layer: with 30 layers that was close to half of the step. In a
 * prefill step the per-layer path allocates every activation afresh (a 2048-token float32 step
 * allocates ~60 MB per layer, which glibc maps and unmaps, so its pages fault and are zeroed
 * again each time); here they live in one scratch buffer that the caller keeps between steps.
 * This file runs the same kernels, in the same order, on the same data (so its output is
 * bit-identical to the per-module path in models/llama.py), with the per-layer pointers
 * gathered once into `MmkitLayer` records (models/llama_decode_stack.py builds them).
 *
 * Per layer, exactly as LlamaDecoderLayer.forward:
 *   h = rms_norm(x [+ residual])  (layer 0: h = rms_norm(embeds), residual = embeds)
 *   qkv = h @ Wqkv^T (+ b); rotate q and k in place; write k, v into the paged cache
 *   a = paged_attention(q, cache) @ Wo^T (+ b)   (decode rows, or rows in tiles with prefill)
 *   h = rms_norm(a + residual), residual = a + residual (in a)
 *   m = silu_mul(h @ Wgate_up^T) @ Wdown^T   (SiLU-mul in the gate/up GEMM's epilogue where it can
 *                                            run: linear_panels_cpu.c, the same bits)
 * then out = rms_norm(m + residual) with the final norm's weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_warm.h"

/* The kernels this stack strings together (the other csrc files, one shared library). */
void mmkit_rms_norm_bf16(uint16_t *out, uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                         int64_t num_tokens, int64_t hidden, float eps, int add_residual, int num_threads);
void mmkit_rotary_bf16(uint16_t *x, const int64_t *positions, const float *cos, const float *signed_sin,
                       int64_t num_tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim, int num_threads);
void mmkit_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t num_tokens, int64_t inter,
                         int num_threads);
void mmkit_rms_norm_f32(float *out, float *x, const float *residual, const float *weight, int64_t num_tokens,
                        int64_t hidden, float eps, int add_residual, int num_threads);
void mmkit_rotary_f32(float *x, const int64_t *positions, const float *cos, const float *signed_sin,
                      int64_t num_tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim, int num_threads);
void mmkit_silu_mul_f32(float *out, const float *gate_up, int64_t num_tokens, int64_t inter, int num_threads);
int mmkit_write_kv(char *k_cache, char *v_cache, const char *k, const char *v, int64_t k_row_stride,
                   int64_t v_row_stride, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                   int64_t num_slots, int64_t head_dim, int64_t elem_size);
int mmkit_paged_decode_attention(void *out, const void *q, int64_t q_row_stride, const void *k_cache,
                                 const void *v_cache, const int64_t *block_ids, int64_t max_blocks,
                                 const int64_t *context_lens, const int64_t *context_starts, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                 int64_t block_size, float scale, int dtype, int num_threads);
int mmkit_paged_rows_attention(void *out, const void *q, int64_t q_row_stride, const void *k_cache,
                               const void *v_cache, const int64_t *block_ids, int64_t max_blocks,
                               const int64_t *context_lens, const int64_t *tiles, int64_t num_tiles,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t num_blocks, int64_t block_size, float scale, int dtype, int num_threads);
int mmkit_panel_gemm_warm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                          const void *panels, const void *bias, int dtype, int nthreads, const MmkitKvWarm *warm);
int mmkit_panel_gemm_silu_mul_warm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t inter,
                                   const void *panels, const void *bias, int dtype, int nthreads,
                                   const MmkitKvWarm *warm);
int mmkit_quant_panel_gemm(uint16_t *out, const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                           const uint8_t *q, int bits, const float *scales, const void *zeros, int64_t group_size,
                           const uint16_t *bias, int64_t direct_max_rows, int nthreads);

int mmkit_lora_add(void *out, const void *x, int64_t x_stride, int64_t num_rows, int64_t k, int64_t n,
                   const int64_t *row_slots, const float *a, const float *bt, const float *scales,
                   const int64_t *slot_mask, const int64_t *bounds, int64_t num_slices, int64_t rank,
                   int dtype, int num_threads);

enum { MMKIT_F32 = 0, MMKIT_BF16 = 1 };

/* A projection's LoRA slots (mmkit/lora/layers.py LoRALinear's buffers; lora_delta_cpu.c). */
typedef struct {
    const float *a;             /* [slots, num_slices * rank, k] */
    const float *bt;            /* [slots, rank, n] (B transposed) */
    const float *scales;        /* [slots, num_slices] */
    const int64_t *slot_mask;   /* [slots]: 1 where the slot holds weights for this projection */
    const int64_t *bounds;      /* [num_slices + 1]: slice i is output columns [bounds[i], bounds[i + 1]) */
    int64_t num_slices, rank;
} MmkitLora;

/* One projection: dense panels (bits == 0, the step's dtype) or quantized panels (bits 4/8, bf16). */
typedef struct {
    const void *weights; /* dense: the panels; quantized: the integers */
    const void *bias;    /* [n] in the step's dtype, or NULL */
    const float *scales;
    const void *zeros;
    int64_t n, k, group_size;
    int64_t bits;
    const MmkitLora *lora; /* NULL: no adapter can touch this projection */
} MmkitLinear;

typedef struct {
    const void *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    void *k_cache, *v_cache;            /* [kv_heads, num_blocks, block_size, head_dim] */
    MmkitLinear qkv, o, gate_up, down;
} MmkitLayer;

typedef struct {
    int64_t num_tokens, hidden, inter, num_heads, num_kv_heads, head_dim;
    int64_t num_blocks, block_size, max_blocks, quant_direct_max_rows;
    const int64_t *positions, *slot_mapping, *block_ids, *context_lens, *context_starts;
    /* NULL: a decode-only step (one row per sequence). Else the step's rows as decode rows
     * whose context ends at their own token, grouped in tiles (mmkit_paged_rows_attention):
     * tile i = rows [tiles[i], tiles[i + 1]), num_tiles of them. */
    const int64_t *tiles;
    int64_t num_tiles;
    const float *cos, *signed_sin;
    float eps, scale;
    int dtype, num_threads;
    const int64_t *lora_slots; /* [num_tokens] adapter slot per row (-1: none), or NULL: no adapter */
    int kv_warm;               /* 1: the MLP's GEMMs warm the next layer's K/V (kv_warm.h; MMKIT_KV_WARM) */
} MmkitStep;

/* Status codes of mmkit_decode_stack. */
enum { STACK_OK = 0, STACK_NO_KERNEL = 1, STACK_OUT_OF_RANGE = 2, STACK_NO_MEMORY = 3 };

/* `warm`: K/V blocks the dense GEMM warms on the way (kv_warm.h), or NULL. */
static int linear(void *out, const void *x, const MmkitLinear *w, const MmkitStep *s, const MmkitKvWarm *warm) {
    const int st = w->bits == 0
        ? mmkit_panel_gemm_warm(out, x, w->k, s->num_tokens, w->k, w->n, w->weights, w->bias, s->dtype,
                                s->num_threads, warm)
        : mmkit_quant_panel_gemm(out, x, w->k, s->num_tokens, w->k, w->n, w->weights, (int)w->bits, w->scales,
                                 w->zeros, w->group_size, w->bias, s->quant_direct_max_rows, s->num_threads);
    if (st == 0 && s->lora_slots && w->lora) {
        const MmkitLora *L = w->lora;
        if (mmkit_lora_add(out, x, w->k, s->num_tokens, w->k, w->n, s->lora_slots, L->a, L->bt, L->scales,
                           L->slot_mask, L->bounds, L->num_slices, L->rank, s->dtype, s->num_threads) != 0)
            return STACK_NO_MEMORY;
    }
    return st == 2 ? STACK_NO_MEMORY : st; /* 1: no kernel for this CPU; 2: an allocation failed */
}

static void rms_norm(const MmkitStep *s, void *out, void *x, const void *residual, const void *weight, int add) {
    if (s->dtype == MMKIT_BF16)
        mmkit_rms_norm_bf16(out, x, residual, weight, s->num_tokens, s->hidden, s->eps, add, s->num_threads);
    else
        mmkit_rms_norm_f32(out, x, residual, weight, s->num_tokens, s->hidden, s->eps, add, s->num_threads);
}

/* Blocks whose K/V the MLP's GEMMs of layer l warm for layer l + 1 (kv_warm.h): a decode-only
 * step's context blocks, per sequence, KV head and block in the order attention's items take
 * them, as byte offsets into a layer's cache (the same in every layer); at most the first
 * 16 MiB of them, half of a 32 MiB L3: warming more pushed out what the next attention reads
 * first (float32 decode-heavy with a 28 MiB cap ran 1.02x the time), while the first 16 MiB of
 * a larger step still pay (0.98x; warming nothing past the cap: 1.01x). 0 (nothing warmed) for
 * steps with prefill rows (compute-bound), when s->kv_warm is 0, or when the list cannot be
 * allocated. *offsets is malloc'd (the caller frees). */
#define MMKIT_KV_WARM_MAX_BYTES (16 << 20)
static int64_t kv_warm_offsets(const MmkitStep *s, int64_t **offsets) {
    *offsets = NULL;
    if (s->tiles || !s->kv_warm) return 0;
    const int64_t es = s->dtype == MMKIT_BF16 ? 2 : 4, bs = s->block_size;
    const int64_t block_bytes = bs * s->head_dim * es;
    int64_t cap = MMKIT_KV_WARM_MAX_BYTES / (2 * block_bytes); /* a K and a V block per offset */
    if (cap > s->num_tokens * s->num_kv_heads * s->max_blocks) cap = s->num_tokens * s->num_kv_heads * s->max_blocks;
    if (cap <= 0 || !(*offsets = malloc(cap * sizeof(int64_t)))) return 0;
    int64_t n = 0;
    for (int64_t q = 0; q < s->num_tokens && n < cap; ++q) {
        const int64_t first = s->context_starts ? s->context_starts[q] / bs : 0;
        const int64_t last = (s->context_lens[q] + bs - 1) / bs;
        for (int64_t h = 0; h < s->num_kv_heads && n < cap; ++h)
            for (int64_t b = first; b < last && n < cap; ++b)
                (*offsets)[n++] = (h * s->num_blocks + s->block_ids[q * s->max_blocks + b]) * block_bytes;
    }
    return n;
}

/* kv_warm_offsets for tests and tools: the step's list, its first `out_len` entries into `out`;
 * returns its length. */
int64_t mmkit_decode_stack_warm_offsets(const MmkitStep *s, int64_t *out, int64_t out_len) {
    int64_t *offsets;
    const int64_t n = kv_warm_offsets(s, &offsets);
    if (n > 0 && out) memcpy(out, offsets, (size_t)(n < out_len ? n : out_len) * sizeof(int64_t));
    free(offsets);
    return n;
}

static int run_layers(const MmkitLayer *layers, int64_t num_layers, const void *final_norm, const void *embeds,
                      void *out, void *work, const MmkitStep *s, int64_t *failed_layer, const int64_t *warm_offsets,
                      int64_t num_warm) {
    const int64_t T = s->num_tokens, H = s->hidden, nh = s->num_heads, nkv = s->num_kv_heads, hd = s->head_dim;
    const int64_t es = s->dtype == MMKIT_BF16 ? 2 : 4, qkv_w = (nh + 2 * nkv) * hd;
    char *w = (char *)work;
    char *bufs[2] = {w, w + T * H * es}; /* the two residual-stream buffers, used in turn */
    char *h = w + 2 * T * H * es;
    char *qkv = h + T * H * es;
    char *attn = qkv + T * qkv_w * es;
    char *gate_up = attn + T * nh * hd * es;
    char *act = gate_up + T * 2 * s->inter * es;
    const void *residual = embeds;
    int turn = 0, st;
    for (int64_t l = 0; l < num_layers; ++l) {
        const MmkitLayer *L = &layers[l];
        *failed_layer = l;
        if (l == 0) rms_norm(s, h, (void *)embeds, embeds, L->input_norm, 0);
        else {
            /* x (the previous MLP output, in bufs[turn]) += residual; h = norm(x) */
            rms_norm(s, h, bufs[turn], residual, L->input_norm, 1);
            residual = bufs[turn];
            turn ^= 1;
        }
        if ((st = linear(qkv, h, &L->qkv, s, NULL)) != 0) return st;
        if (s->dtype == MMKIT_BF16)
            mmkit_rotary_bf16((uint16_t *)qkv, s->positions, s->cos, s->signed_sin, T, qkv_w, nh + nkv, hd,
                              s->num_threads);
        else
            mmkit_rotary_f32((float *)qkv, s->positions, s->cos, s->signed_sin, T, qkv_w, nh + nkv, hd,
                             s->num_threads);
        if ((st = mmkit_write_kv(L->k_cache, L->v_cache, qkv + nh * hd * es, qkv + (nh + nkv) * hd * es, qkv_w,
                                 qkv_w, s->slot_mapping, T, nkv, s->num_blocks * s->block_size, hd, es)) != 0)
            return STACK_OUT_OF_RANGE;
        st = s->tiles
            ? mmkit_paged_rows_attention(attn, qkv, qkv_w, L->k_cache, L->v_cache, s->block_ids, s->max_blocks,
                                         s->context_lens, s->tiles, s->num_tiles, T, nh, nkv, hd, s->num_blocks,
                                         s->block_size, s->scale, s->dtype, s->num_threads)
            : mmkit_paged_decode_attention(attn, qkv, qkv_w, L->k_cache, L->v_cache, s->block_ids, s->max_blocks,
                                           s->context_lens, s->context_starts, T, nh, nkv, hd, s->num_blocks,
                                           s->block_size, s->scale, s->dtype, s->num_threads);
        if (st != 0)
            return st == 2 ? STACK_OUT_OF_RANGE : STACK_NO_MEMORY;
        char *a = bufs[turn];
        if ((st = linear(a, attn, &L->o, s, NULL)) != 0) return st;
        rms_norm(s, h, a, residual, L->post_norm, 1); /* a becomes the residual stream */
        residual = a;
        turn ^= 1;
        /* the next layer's K/V: two thirds warmed by gate/up, the rest by down (their shares of
         * the MLP's arithmetic) */
        const int warm_next = num_warm && l + 1 < num_layers;
        const char *nk = warm_next ? layers[l + 1].k_cache : NULL, *nv = warm_next ? layers[l + 1].v_cache : NULL;
        const int64_t split = 2 * num_warm / 3, lines = s->block_size * hd * es / 64;
        const MmkitKvWarm warm_gu = {warm_offsets, split, nk, nv, lines};
        const MmkitKvWarm warm_down = {warm_offsets + split, num_warm - split, nk, nv, lines};
        /* dense panels without an adapter on gate/up: SiLU-mul in the GEMM's epilogue (returns 1
         * where it cannot run: AVX2 build, inter not a multiple of 32); else the two passes */
        if (L->gate_up.bits != 0 || (s->lora_slots && L->gate_up.lora) ||
            mmkit_panel_gemm_silu_mul_warm(act, h, L->gate_up.k, T, L->gate_up.k, s->inter, L->gate_up.weights,
                                           L->gate_up.bias, s->dtype, s->num_threads,
                                           warm_next ? &warm_gu : NULL) != 0) {
            if ((st = linear(gate_up, h, &L->gate_up, s, warm_next ? &warm_gu : NULL)) != 0) return st;
            if (s->dtype == MMKIT_BF16)
                mmkit_silu_mul_bf16((uint16_t *)act, (const uint16_t *)gate_up, T, s->inter, s->num_threads);
            else mmkit_silu_mul_f32((float *)act, (const float *)gate_up, T, s->inter, s->num_threads);
        }
        if ((st = linear(bufs[turn], act, &L->down, s, warm_next ? &warm_down : NULL)) != 0) return st;
    }
    *failed_layer = -1;
    if (num_layers == 0) rms_norm(s, out, (void *)embeds, embeds, final_norm, 0);
    else rms_norm(s, out, bufs[turn], residual, final_norm, 1);
    return STACK_OK;
}

/* embeds: [T, hidden] (only read); out: [T, hidden], the final norm's output; work: scratch of
 * mmkit_decode_stack_work_bytes(). Returns STACK_OK, or with the layer in *failed_layer:
 * STACK_NO_KERNEL (this build lacks the AVX512-BF16 panels), STACK_OUT_OF_RANGE (a slot, block
 * id or length out of range: bounds-checking build), STACK_NO_MEMORY (a kernel's scratch). */
int mmkit_decode_stack(const MmkitLayer *layers, int64_t num_layers, const void *final_norm, const void *embeds,
                       void *out, void *work, const MmkitStep *s, int64_t *failed_layer) {
    int64_t *warm_offsets;
    const int64_t num_warm = kv_warm_offsets(s, &warm_offsets);
    const int st = run_layers(layers, num_layers, final_norm, embeds, out, work, s, failed_layer, warm_offsets, num_warm);
    free(warm_offsets);
    return st;
}

/* Scratch bytes mmkit_decode_stack needs for a step of `num_tokens` rows. */
int64_t mmkit_decode_stack_work_bytes(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, int dtype) {
    const int64_t es = dtype == MMKIT_BF16 ? 2 : 4;
    return num_tokens * es * (3 * hidden + (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim +
                              3 * inter);
}
