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
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

/* -1 - i for the first token whose slot is past the cache, else 0. */
static int64_t first_bad_slot(const int64_t *slots, int64_t t, int64_t num_slots) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return -1 - i;
    return 0;
}

int64_t store_kv_cpu(const void *k, int64_t ldk, const void *v, int64_t ldv, void *k_cache,
                     void *v_cache, const int64_t *slots, int64_t t, int64_t row,
                     int64_t num_slots, int32_t elem_bytes) {
    const int64_t bad = first_bad_slot(slots, t, num_slots);
    if (bad) return bad;
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

/* One head's d values (fp32 or bf16) as int8 codes and a scale per KV_GROUP, the
 * rounding of kv_quant.quantize_kv bit for bit: scale = amax / 127 (NaN when a value is
 * NaN), code = round-half-even(x / scale) clamped to +-127, 0 where the scale is 0 or
 * NaN or the quotient is NaN (an infinite value over an infinite scale). */
static void quantize_row(const void *src, int bf16, int64_t d, int8_t *dst) {
    for (int64_t g = 0; g < d / KV_GROUP; g++) {
        const int64_t c0 = g * KV_GROUP;
        float amax = 0.0f;
        for (int64_t c = c0; c < c0 + KV_GROUP; c++) {
            const float a = fabsf(load1(src, c, bf16));
            amax = (a > amax || a != a) ? a : amax; /* NaN sticks, as torch's amax */
            if (amax != amax) break;
        }
        const float scale = amax / 127.0f;
        for (int64_t c = c0; c < c0 + KV_GROUP; c++) {
            float q = scale > 0.0f ? load1(src, c, bf16) / scale : 0.0f;
            q = q != q ? 0.0f : nearbyintf(q);
            dst[c] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        memcpy(dst + d + 4 * g, &scale, sizeof scale);
    }
}

/* store_kv into an int8 cache: k, v [T, Hkv x D] fp32 or bf16 (src_bf16), rows ldk / ldv
 * elements apart; each cache slot holds Hkv rows of D codes and D / 32 scales. Returns
 * as store_kv_cpu, or 1 when D is not a multiple of 32. */
int64_t store_kv_int8_cpu(const void *k, int64_t ldk, const void *v, int64_t ldv,
                          void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
                          int64_t hkv, int64_t d, int64_t num_slots, int32_t src_bf16) {
    const int64_t bad = first_bad_slot(slots, t, num_slots);
    if (bad) return bad;
    if (d % KV_GROUP) return 1;
    const size_t es = src_bf16 ? 2 : 4, hs = (size_t)kv_int8_row(d);
    for (int64_t i = 0; i < t; i++) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        for (int64_t h = 0; h < hkv; h++) {
            const size_t at = ((size_t)s * (size_t)hkv + (size_t)h) * hs;
            quantize_row((const char *)k + (size_t)(i * ldk + h * d) * es, src_bf16, d,
                         (int8_t *)k_cache + at);
            quantize_row((const char *)v + (size_t)(i * ldv + h * d) * es, src_bf16, d,
                         (int8_t *)v_cache + at);
        }
    }
    return 0;
}
