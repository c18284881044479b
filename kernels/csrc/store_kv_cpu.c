/* store_kv for the CPU: each token's K and V rows copied into their cache slots in one
 * call (in torch: a padding check that reads the slots back, two casts and two
 * index_copy_ calls, ~40 us a layer at decode, more than the copy itself).
 *
 *   k, v      [T, row] elements (a token's Hkv x D values contiguous), rows ldk / ldv
 *             apart, of the cache's element size (4: fp32, 2: bf16)
 *   k_cache   [num_slots, row], contiguous; v_cache likewise
 *   slots     [T] int64; a negative slot is padding and is skipped
 * Returns 0, or -1 - t for the first token whose slot is past the cache (nothing is
 * written then).
 */
#include <stdint.h>
#include <string.h>

int64_t store_kv_cpu(const void *k, int64_t ldk, const void *v, int64_t ldv, void *k_cache,
                     void *v_cache, const int64_t *slots, int64_t t, int64_t row,
                     int64_t num_slots, int32_t elem_bytes) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return -1 - i;
    size_t bytes = (size_t)(row * elem_bytes);
    for (int64_t i = 0; i < t; i++) {
        int64_t s = slots[i];
        if (s < 0) continue;
        memcpy((char *)k_cache + (size_t)s * bytes, (const char *)k + (size_t)(i * ldk) * elem_bytes,
               bytes);
        memcpy((char *)v_cache + (size_t)s * bytes, (const char *)v + (size_t)(i * ldv) * elem_bytes,
               bytes);
    }
    return 0;
}
