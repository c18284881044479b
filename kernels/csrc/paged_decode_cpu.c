/* Paged decode attention for the CPU: one query token per sequence against its cached
 * keys, read straight from the paged K/V cache (no gather into a dense copy).
 *
 * Built by kernels/cpu_native.py with the system C compiler and loaded through ctypes, so it
 * needs no torch headers (a build takes about a second). Layout as in docs/kernels.md:
 *   q        [B, Hq, D]            float32, contiguous, already multiplied by the scale
 *   k/v      [NB, BS, Hkv, D]      float32 or bfloat16, contiguous; or int8 [NB, BS, Hkv,
 *            D * 9 / 8] (cache_kind KV_INT8: codes and scales, as vec16.h says), which
 *            only the 16-lane kernel reads (head dim 64 or 128, groups up to 8)
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

/* The 16-lane kernel for head dims 64 / 128 / 256 (256 not for an int8 cache) and groups
 * up to 8 (paged_decode_wide_cpu.c); 1 for other shapes, which the 8-lane kernel below
 * takes. */
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

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load_f32(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof x);  /* unaligned load */
    return x;
}

static inline v8f load_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;  /* bf16 is fp32's top half */
    v8f x;
    memcpy(&x, &w, sizeof x);
    return x;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* Lane-wise m ? a : b (m lanes all-ones or zero); C has no ?: on vectors. */
static inline v8f vsel(v8i m, v8f a, v8f b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
 * error ~2e-7, below fp32 softmax noise), 2^n put straight into the exponent bits. Lanes
 * below -87.3 (e^x under FLT_MIN, and -inf) give exactly 0; x is never above 0 here. */
static inline v8f exp_v8(v8f x) {
    const v8f lo = (v8f){0} - 87.3f;
    v8i tiny = x < lo;
    x = vsel(tiny, lo, x); /* keeps n in range; those lanes are zeroed below */
    /* n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer in the current (nearest)
     * mode without a float->int->float trip. */
    v8f fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v8f r = x - fn * 0.693359375f + fn * 2.12194440e-4f; /* ln2 split in two: exact n ln2 */
    v8f p = 1.9875691500e-4f + (v8f){0};
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v8i bits = (__builtin_convertvector(fn, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    v8f y = p * scale;
    return vsel(tiny, (v8f){0}, y);
}

#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* The horizontal sums of eight vectors as one vector (r[t] = sum of x[t]'s lanes): a
 * transpose-and-add tree, 12 shuffles + 7 adds instead of 8 separate reductions. */
static inline v8f hsum8(const v8f *x) {
    v8f b[4], c[2];
    for (int k = 0; k < 4; ++k)
        b[k] = SHUF(x[2 * k], x[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + SHUF(x[2 * k], x[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; ++k)
        c[k] = SHUF(b[2 * k], b[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUF(b[2 * k], b[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + SHUF(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float hsum(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* The n scores of each of `heads` rows of s (MAX_BLOCK apart) soft-capped. One call a
 * block, out of line: with the loop over heads inline, the kernel ran up to 5% slower
 * without a cap for some head dims (40). */
static __attribute__((noinline)) void cap_rows(float *s, int64_t heads, int64_t n,
                                               float cap) {
    for (int64_t i = 0; i < heads; ++i) softcap_scores(s + i * MAX_BLOCK, n, cap);
}

static inline v8f load_vec(const void *cache, int64_t offset, int is_bf16) {
    return is_bf16 ? load_bf16((const uint16_t *)cache + offset)
                   : load_f32((const float *)cache + offset);
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
    /* Scores per head, padded with -inf to whole vectors (e^-inf = 0 in exp_v8). */
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
                                x += qi[c] * load_vec(k_cache, off + 8 * c, is_bf16);
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
                v8f e = exp_v8(load_f32(si + 8 * c) - mnew);
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
                for (int64_t c = 0; c < chunks; ++c) v[c] = load_vec(v_cache, off + 8 * c, is_bf16);
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
