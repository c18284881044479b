/* Paged decode attention for the CPU: one query token per sequence against its cached
 * keys, read straight from the paged K/V cache (no gather into a dense copy).
 *
 * Built by kernels/cpu_native.py with the system C compiler and loaded through ctypes, so it
 * needs no torch headers (a build takes about a second). Layout as in docs/kernels.md:
 *   q        [B, Hq, D]            float32, contiguous, already multiplied by the scale
 *   k/v      [NB, BS, Hkv, D]      float32 or bfloat16, contiguous; or int8 [NB, BS, Hkv,
 *            D * 9 / 8] (cache_kind KV_INT8: codes and scales, as vec16.h says), which
 *            only the wide kernel reads (head dim 64 or 128, groups up to 8)
 *   tables   [B, W]                int32 or int64, rows `table_stride` apart
 *   seq_lens [B]                   int32
 *   out      [B, Hq, D]            float32, contiguous
 * window > 0: a sliding window, each query sees its sequence's last `window` keys.
 * softcap > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma
 * 2's logit soft-capping; s already scaled, as q is); 0: none.
 * D must be a multiple of 8 (one 8-float vector: AVX2, or two NEON registers).
 *
 * Work item = one sequence, all its heads: each K/V token row is loaded once and serves
 * every query head of its KV head group (a batch smaller than the thread count is also
 * split by KV head). Per block: the scores, one online-softmax rescale per query head,
 * then the weighted V rows. fp32 math throughout.
 * GCC/Clang vector extensions keep it portable while making the SIMD explicit: the
 * compiler will not vectorise a float dot product by itself (that would reorder sums).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h" /* KV_* cache kinds */
#include "vec8.h"

/* The wide kernel for head dims 64 / 128 / 256 (256 not for an int8 cache) and groups
 * up to 8 (paged_decode_wide_cpu.c: 16 lanes with AVX-512, else 8); 1 for other shapes,
 * which the general kernel below takes. */
int paged_decode_wide_takes(int64_t group, int64_t dim, int kind);
int64_t paged_decode_wide_seq(const float *q, const void *k_cache, const void *v_cache,
                              int kind, const int64_t *blocks, int64_t lo, int64_t len,
                              int64_t block_size, int64_t num_kv_heads, int64_t h0,
                              int64_t nh, int64_t group, int64_t dim, float softcap,
                              float *out);
/* n scores soft-capped in place (cap > 0), vectorised (paged_decode_wide_cpu.c). */
int64_t softcap_scores(float *s, int64_t n, float cap);

#define MAX_BLOCK 64  /* largest block_size the engine allows */
#define MAX_GROUP 64  /* query heads per KV head */
#define MAX_CHUNKS 64 /* head dim <= 512 */
#define BAD_SHAPE 1

/* The n scores of each of `heads` rows of s (MAX_BLOCK apart) soft-capped. One call a
 * block, out of line: with the loop over heads inline, the kernel ran up to 5% slower
 * without a cap for some head dims (40). */
static __attribute__((noinline)) void cap_rows(float *s, int64_t heads, int64_t n,
                                               float cap) {
    for (int64_t i = 0; i < heads; ++i) softcap_scores(s + i * MAX_BLOCK, n, cap);
}

/* One sequence, KV heads h0 .. h0 + nh - 1 of its num_kv_heads (all of them unless a
 * small batch is split over threads by head): `q` holds those heads' query rows (KV head
 * h's `group` heads at rows (h - h0) * group ...), `out` gets theirs. `blocks` are the
 * sequence's first ceil(len / block_size) block ids, all valid. `chunks` (head dim / 8) is
 * a literal at each call site (attend_seq_dispatch), so the short D-loops unroll. */
static inline __attribute__((always_inline)) void attend_seq(
    const float *restrict q, const void *k_cache, const void *v_cache, int is_bf16,
    const int64_t *blocks, int64_t lo, int64_t len, int64_t block_size,
    int64_t num_kv_heads, int64_t h0, int64_t nh, int64_t group, const int64_t chunks,
    float softcap, float *restrict out) {
    const int64_t heads = nh * group, row = num_kv_heads * chunks * 8;
    v8f qv[heads * chunks], acc[heads * chunks];
    /* Scores per head, padded with -inf to whole vectors (e^-inf = 0 in exp8). */
    float s[heads * MAX_BLOCK] __attribute__((aligned(32))), m[heads], l[heads];
    for (int64_t i = 0; i < heads * chunks; ++i) {
        qv[i] = load_f32(q + 8 * i);
        acc[i] = (v8f){0};
    }
    for (int64_t i = 0; i < heads; ++i) { m[i] = -INFINITY; l[i] = 0.0f; }
    const int64_t nblocks = (len + block_size - 1) / block_size;
    for (int64_t j = lo / block_size; j < nblocks; ++j) {
        int64_t n = len - j * block_size;
        if (n > block_size) n = block_size;
        /* Keys [lo, len): the first block visited starts at lo's row (a sliding window). */
        const int64_t skip = j * block_size < lo ? lo - j * block_size : 0;
        n -= skip;
        const int64_t base = blocks[j] * block_size * row + skip * row, nv = (n + 7) / 8;
        if (j + 1 < nblocks && nh == num_kv_heads) {
            /* Blocks are scattered, so the hardware prefetcher restarts at each one: ask
             * for the next block's K and V lines while this one is computed (whole rows:
             * not when the block's heads are split between threads). */
            const int64_t esize = is_bf16 ? 2 : 4, bytes = block_size * row * esize;
            const char *kn = (const char *)k_cache + blocks[j + 1] * bytes;
            const char *vn = (const char *)v_cache + blocks[j + 1] * bytes;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(kn + b, 0, 0);
                __builtin_prefetch(vn + b, 0, 0);
            }
        }
        /* Scores, eight tokens at a time per head: eight dot-product vectors, one
         * reduction tree. K rows are read from the cache itself (L1 after the group's
         * first head). */
        for (int64_t h = 0; h < nh; ++h) {
            const int64_t koff = base + (h0 + h) * chunks * 8;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t i = h * group + g;
                const v8f *qi = qv + i * chunks;
                for (int64_t t0 = 0; t0 < nv * 8; t0 += 8) {
                    v8f d[8];
                    for (int64_t u = 0; u < 8; ++u) {
                        v8f x = (v8f){0};
                        if (t0 + u < n) {
                            const int64_t off = koff + (t0 + u) * row;
                            for (int64_t c = 0; c < chunks; ++c)
                                x += qi[c] * load8(k_cache, off + 8 * c, is_bf16);
                        }
                        d[u] = x;
                    }
                    v8f r = hsum8(d);
                    memcpy(s + i * MAX_BLOCK + t0, &r, sizeof r);
                }
            }
        }
        if (__builtin_expect(softcap > 0, 0)) cap_rows(s, heads, n, softcap); /* before max */
        for (int64_t i = 0; i < heads; ++i) {
            float *si = s + i * MAX_BLOCK;
            for (int64_t t = n; t < nv * 8; ++t) si[t] = -INFINITY;
            v8f vmax = load_f32(si);
            for (int64_t c = 1; c < nv; ++c) {
                v8f x = load_f32(si + 8 * c);
                vmax = vsel(x > vmax, x, vmax);
            }
            float bmax = vmax[0];
            for (int k = 1; k < 8; ++k) bmax = vmax[k] > bmax ? vmax[k] : bmax;
            const float mnew = m[i] > bmax ? m[i] : bmax;
            const float corr = expf(m[i] - mnew); /* exp(-inf) = 0 on the first block */
            v8f vsum = (v8f){0};
            for (int64_t c = 0; c < nv; ++c) {
                v8f e = exp8(load_f32(si + 8 * c) - mnew);
                memcpy(si + 8 * c, &e, sizeof e);
                vsum += e;
            }
            l[i] = l[i] * corr + hsum(vsum);
            m[i] = mnew;
            for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] *= corr;
        }
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t h = 0; h < nh; ++h) {
                const int64_t off = base + t * row + (h0 + h) * chunks * 8;
                v8f v[chunks];
                for (int64_t c = 0; c < chunks; ++c) v[c] = load8(v_cache, off + 8 * c, is_bf16);
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * group + g;
                    const float p = s[i * MAX_BLOCK + t];
                    for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] += p * v[c];
                }
            }
        }
    }
    for (int64_t i = 0; i < heads; ++i) {
        const float inv = 1.0f / l[i];
        for (int64_t c = 0; c < chunks; ++c) {
            v8f o = acc[i * chunks + c] * inv;
            memcpy(out + (i * chunks + c) * 8, &o, sizeof o);
        }
    }
}

/* attend_seq with the head dim's vector count as a constant for the common sizes. */
static void attend_seq_dispatch(const float *q, const void *k_cache, const void *v_cache,
                                int is_bf16, const int64_t *blocks, int64_t lo,
                                int64_t len, int64_t block_size, int64_t num_kv_heads,
                                int64_t h0, int64_t nh, int64_t group, int64_t chunks,
                                float softcap, float *out) {
#define ATTEND(C) attend_seq(q, k_cache, v_cache, is_bf16, blocks, lo, len, block_size, \
                             num_kv_heads, h0, nh, group, C, softcap, out)
    switch (chunks) {
        case 1: ATTEND(1); break;
        case 2: ATTEND(2); break;
        case 4: ATTEND(4); break;
        case 8: ATTEND(8); break;
        case 16: ATTEND(16); break;
        default: ATTEND(chunks); break;
    }
#undef ATTEND
}

/* Returns 0 on success; BAD_SHAPE for sizes the kernel cannot take (the Python side checks
 * them first); or -(b + 1) for a sequence b whose length needs more blocks than its table
 * row holds, or whose table names a block outside the cache: nothing is read for it and
 * its output rows are left as they were. */
int64_t paged_decode_attention_cpu(
    const float *q, const void *k_cache, const void *v_cache, const void *block_tables,
    const int32_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
    int64_t num_kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size,
    int64_t table_width, int64_t table_stride, int32_t cache_kind,
    int32_t tables_are_int64, int64_t window, float softcap, int32_t num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || dim <= 0 || dim % 8 != 0)
        return BAD_SHAPE;
    int64_t group = num_heads / num_kv_heads, chunks = dim / 8;
    if (group > MAX_GROUP || chunks > MAX_CHUNKS || block_size <= 0 || block_size > MAX_BLOCK)
        return BAD_SHAPE;
    if (cache_kind < KV_F32 || cache_kind > KV_INT8 ||
        (cache_kind == KV_INT8 && !paged_decode_wide_takes(group, dim, KV_INT8)))
        return BAD_SHAPE;
    const int cache_is_bf16 = cache_kind == KV_BF16;
    /* Work items: sequences, each cut into `splits` KV-head ranges when there are fewer
     * sequences than threads (a small batch still uses every thread). */
    int64_t splits = 1;
    if (batch < num_threads) {
        splits = (num_threads + batch - 1) / batch;
        if (splits > num_kv_heads) splits = num_kv_heads;
    }
    const int64_t items = batch * splits;
    int64_t bad = 0; /* some failing sequence; which one wins a race does not matter */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t b = item / splits, part = item % splits;
        const int64_t h0 = part * num_kv_heads / splits;
        const int64_t nh = (part + 1) * num_kv_heads / splits - h0;
        const int64_t len = seq_lens[b];
        const float *qb = q + (b * num_heads + h0 * group) * dim;
        float *ob = out + (b * num_heads + h0 * group) * dim;
        if (len <= 0) { /* attention over nothing: zeros */
            memset(ob, 0, sizeof(float) * nh * group * dim);
            continue;
        }
        int64_t nblocks = (len + block_size - 1) / block_size;
        if (nblocks > table_width) {
#pragma omp atomic write
            bad = -(b + 1);
            continue;
        }
        int64_t ids[nblocks];
        int ok = 1;
        for (int64_t j = 0; j < nblocks; ++j) {
            ids[j] = tables_are_int64
                ? ((const int64_t *)block_tables)[b * table_stride + j]
                : ((const int32_t *)block_tables)[b * table_stride + j];
            ok &= ids[j] >= 0 && ids[j] < num_blocks;
        }
        if (!ok) {
#pragma omp atomic write
            bad = -(b + 1);
            continue;
        }
        /* A sliding window (window > 0): the query, at len - 1, sees the last window keys. */
        const int64_t lo = window > 0 && len > window ? len - window : 0;
        if (paged_decode_wide_seq(qb, k_cache, v_cache, cache_kind, ids, lo, len, block_size,
                                  num_kv_heads, h0, nh, group, dim, softcap, ob))
            attend_seq_dispatch(qb, k_cache, v_cache, cache_is_bf16, ids, lo, len, block_size,
                                num_kv_heads, h0, nh, group, chunks, softcap, ob);
    }
    return bad;
}
