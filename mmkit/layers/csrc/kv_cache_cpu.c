/* Writing a step's new K/V rows into the paged cache ([num_kv_heads, num_slots, head_dim] per
 * layer, num_slots = num_blocks * block_size). A plain row copy, on the calling thread: the
 * rows of a step are small (a decode step writes ~100 KB), and torch's index_copy_ paid an
 * OpenMP wake-up per call (tens of microseconds under OMP_WAIT_POLICY=PASSIVE) for it. */
#include <stdint.h>
#include <string.h>

/* k, v: token t, head h at k + (t * row_stride + h * head_dim) * elem_size (heads dense).
 * Returns 0, or 2 (bounds-checking build, -DMMKIT_KERNEL_CHECKS) when a slot is out of range:
 * then nothing is written. */
int mmkit_write_kv(char *k_cache, char *v_cache, const char *k, const char *v, int64_t k_row_stride,
                    int64_t v_row_stride, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                    int64_t num_slots, int64_t head_dim, int64_t elem_size) {
    const int64_t row_bytes = head_dim * elem_size;
#ifdef MMKIT_KERNEL_CHECKS
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
#endif
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (h * num_slots + slot) * row_bytes;
            memcpy(k_cache + dst, k + (t * k_row_stride + h * head_dim) * elem_size, (size_t)row_bytes);
            memcpy(v_cache + dst, v + (t * v_row_stride + h * head_dim) * elem_size, (size_t)row_bytes);
        }
    }
    return 0;
}
