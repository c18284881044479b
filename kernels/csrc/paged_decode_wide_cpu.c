/* Paged decode attention for one sequence with the group size and head dim fixed at
 * compile time, for the common shapes: head dim 64, 128 or 256 (256: fp32 and bf16 caches
 * only; an int8 cache at 64 / 128) and up to 8 query heads per KV head. Vectors of 16
 * lanes where the CPU has AVX-512, else 8 (LANES below). Called by paged_decode_cpu.c for
 * each work item; it returns 1 for a shape it does not take, and the general kernel there
 * runs it instead. Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: the general kernel sizes its per-head arrays at run time, so its accumulators live
 * in memory and each K row is widened once per query head; on 2 cores it ran at ~38 ns
 * per token and KV head (bf16 cache, 64 wide, 3 heads a group), about 7 GB/s, which made
 * attention a fifth of a batched decode step. Here the group size and the head dim are
 * constants at each call (one instantiation per pair), the query rows and accumulators of
 * a KV head's group stay in registers (or L1 where they outnumber them), and each K and V
 * row is widened once for all of the group's heads.
 *
 * Per KV head: its query heads walk the sequence 16 tokens at a time. Scores: one dot
 * product vector per (token, head), summed across lanes by a transpose-and-add tree (a
 * vector of LANES sums from LANES vectors). Softmax: online, rescaled once per 16 tokens.
 * Then the 16 weighted V rows. fp32 math, as the general kernel; sums run in another
 * order, so results agree to fp32 rounding.
 *
 *   q    [heads, D] float32, the item's query rows (KV head h's group at h * G), scaled
 *   k/v  the whole cache [NB, BS, Hkv, D], float32 or bfloat16; or int8 (kind KV_INT8,
 *        vec16.h): [NB, BS, Hkv, D * 9 / 8], each row's codes then its scales, widened
 *        to floats and scaled as they are loaded
 *   out  [heads, D] float32
 * softcap > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma
 * 2's logit soft-capping); 0: none.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_lanes.h"

#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

/* r[t] = the sum of x[t]'s lanes, t < 16: pairs, then quads, octets, halves. */
static inline v16f hsum16(const v16f *x) {
    v16f b[8], c[4], e[2];
    for (int k = 0; k < 8; ++k)
        b[k] = SHUF(x[2 * k], x[2 * k + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                    14, 30)
             + SHUF(x[2 * k], x[2 * k + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                    15, 31);
    for (int k = 0; k < 4; ++k)
        c[k] = SHUF(b[2 * k], b[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                    28, 29)
             + SHUF(b[2 * k], b[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                    30, 31);
    for (int k = 0; k < 2; ++k)
        e[k] = SHUF(c[2 * k], c[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                    26, 27)
             + SHUF(c[2 * k], c[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                    30, 31);
    return SHUF(e[0], e[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + SHUF(e[0], e[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* hsum16 for 16 lanes (AVX-512), hsum8 for 8 (vec_lanes.h). */
#if LANES == 16
#define VHSUM hsum16
#else
#define VHSUM hsum8
#endif
/* Tokens per softmax step: 16 on 8 lanes too (two score vectors a head), ~5% faster
 * there than 8 (half the rescales). */
#define TOKENS 16
#define SV (TOKENS / LANES) /* score vectors per step */

/* Logit soft-capping, cap * tanh(s / cap), on LANES lanes (cap > 0). tanh(a) for a = |x|:
 * below 0.625 the odd polynomial a + a^3 P(a^2), P fitted here (weighted least squares,
 * relative error ~4e-9 on [0, 0.625]); above, 1 - 2 / (e^2a + 1), which cancels little
 * there (tanh >= 0.55). With fp32 rounding both stay within ~3e-7 of tanh, relative:
 * libm's tanhf would be a scalar call per score. +-inf give +-cap, NaN stays NaN. */
static inline vf softcap_v(vf s, float cap) {
    const vf x = s * (1.0f / cap);
    vi bits, sign;
    memcpy(&bits, &x, sizeof bits);
    sign = bits & INT32_MIN;
    bits &= INT32_MAX;
    vf a;
    memcpy(&a, &bits, sizeof a);
    const vf y = a * a;
    vf p = -5.706666969e-03f + (vf){0};
    p = p * y + 2.064054646e-02f;
    p = p * y - 5.374014750e-02f;
    p = p * y + 1.333144754e-01f;
    p = p * y - 3.333328068e-01f;
    const vf near0 = a + a * y * p;
    const vf far = 1.0f - 2.0f / (VEXP(a + a) + 1.0f); /* VEXP clamps: finite */
    vf t = VSEL(a < 0.625f, near0, far);
    memcpy(&bits, &t, sizeof bits);
    bits |= sign;
    memcpy(&t, &bits, sizeof t);
    return t * cap;
}

/* s[0 .. n) soft-capped in place (cap > 0; see softcap_v), for every attention kernel.
 * Never inlined: a call in their loops costs nothing when not taken, where the inline code
 * slowed some of them down (register pressure) even without a cap. Returns 0. */
__attribute__((noinline)) int64_t softcap_scores(float *s, int64_t n, float cap) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf x;
        memcpy(&x, s + i, sizeof x);
        x = softcap_v(x, cap);
        memcpy(s + i, &x, sizeof x);
    }
    if (i < n) { /* the tail in a zero-padded vector */
        vf x = {0};
        memcpy(&x, s + i, (size_t)(n - i) * sizeof(float));
        x = softcap_v(x, cap);
        memcpy(s + i, &x, (size_t)(n - i) * sizeof(float));
    }
    return 0;
}

/* Ask for the `bytes` bytes of a cache row at element offset `off` (elements `esize`
 * bytes wide), a cache line at a time. Forced inline: left as a call, the attention loop
 * ran 2x slower. */
static inline __attribute__((always_inline)) void request_row(const void *cache,
                                                              int64_t off, int64_t bytes,
                                                              int64_t esize) {
    const char *p = (const char *)cache + off * esize;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* The C vectors of one K or V row at cache offset `at` as floats: widened from bf16 or
 * fp32, or (I8, a literal) int8 codes widened and multiplied by their group's scale. */
static inline __attribute__((always_inline)) void load_row(const void *cache, int64_t at,
                                                           int is_bf16, const int I8,
                                                           const int C, vf *r) {
    if (I8) {
        const int8_t *p = (const int8_t *)cache + at;
        for (int c = 0; c < C; ++c)
            r[c] = VLOAD_I8(p + LANES * c) * kv_scale(p, C * LANES, LANES * c / KV_GROUP);
    } else {
        for (int c = 0; c < C; ++c) r[c] = VLOAD(cache, at + LANES * c, is_bf16);
    }
}

/* The n tokens (n <= the block size) of one block for KV head h and its G query heads,
 * from cache offset `base` (token 0, head h; offsets and `row` count elements, bytes for
 * an int8 cache: I8 is a literal, so each kind compiles its own loop); `next` is the same
 * offset in the next block
 * (-1: none), whose rows are requested as this block's are read (blocks are scattered,
 * and requests spread out do not queue up behind each other). qv: the G query rows;
 * acc, m, l: the heads' running output, max and sum, updated; cap > 0: soft-capping. */
static inline __attribute__((always_inline)) void attend_block(
    const vf *restrict qv, const void *k_cache, const void *v_cache, int is_bf16,
    const int I8, int64_t n, int64_t base, int64_t next, int64_t row, const int G,
    const int C, float cap, vf *restrict acc_out, float *restrict m, float *restrict l) {
    const int64_t d = C * LANES, esize = I8 ? 1 : is_bf16 ? 2 : 4;
    const int64_t row_bytes = I8 ? kv_int8_row(d) : d * esize;
    vf acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = acc_out[g * C + c];
    for (int64_t t0 = 0; t0 < n; t0 += TOKENS) {
        const int64_t nt = n - t0 < TOKENS ? n - t0 : TOKENS;
        vf dots[G][TOKENS];
        for (int64_t u = 0; u < TOKENS; ++u) {
            if (u >= nt) {
                for (int g = 0; g < G; ++g) dots[g][u] = (vf){0};
                continue;
            }
            if (next >= 0) request_row(k_cache, next + (t0 + u) * row, row_bytes, esize);
            vf kr[C];
            load_row(k_cache, base + (t0 + u) * row, is_bf16, I8, C, kr);
            for (int g = 0; g < G; ++g) {
                vf x = qv[g * C] * kr[0];
                for (int c = 1; c < C; ++c) x += qv[g * C + c] * kr[c];
                dots[g][u] = x;
            }
        }
        float p[G][TOKENS] __attribute__((aligned(64)));
        /* All the heads' scores before any softmax, capped by a call marked unlikely (a
         * branch per 16 tokens; registers spilled only when taken): so the loops without
         * a cap run as before it. Inline, the cap's code slowed them by up to 6% (64 wide,
         * one head a group). Dead lanes: 0, capped to 0, masked next. */
        vf sc[G][SV];
        for (int g = 0; g < G; ++g)
            for (int k = 0; k < SV; ++k) sc[g][k] = VHSUM(&dots[g][k * LANES]);
        if (__builtin_expect(cap > 0, 0)) softcap_scores((float *)sc, G * TOKENS, cap);
        for (int g = 0; g < G; ++g) {
            vf s[SV];
            float bmax = -INFINITY;
            for (int k = 0; k < SV; ++k) {
                s[k] = VSEL(lane_ids(k * LANES) < (int32_t)nt, sc[g][k], (vf){0} - INFINITY);
                for (int j = 0; j < LANES; ++j) bmax = s[k][j] > bmax ? s[k][j] : bmax;
            }
            const float mnew = m[g] > bmax ? m[g] : bmax;
            const float corr = expf(m[g] - mnew); /* exp(-inf) = 0 at the start */
            float sum = 0.0f;
            for (int k = 0; k < SV; ++k) {
                vf e = VEXP(s[k] - mnew);
                for (int j = 0; j < LANES; ++j) sum += e[j];
                memcpy(p[g] + k * LANES, &e, sizeof e);
            }
            l[g] = l[g] * corr + sum;
            m[g] = mnew;
            for (int c = 0; c < C; ++c) acc[g][c] *= corr;
        }
        for (int64_t u = 0; u < nt; ++u) {
            if (next >= 0) request_row(v_cache, next + (t0 + u) * row, row_bytes, esize);
            vf vr[C];
            load_row(v_cache, base + (t0 + u) * row, is_bf16, I8, C, vr);
            for (int g = 0; g < G; ++g) {
                const float w = p[g][u];
                for (int c = 0; c < C; ++c) acc[g][c] += w * vr[c];
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc_out[g * C + c] = acc[g][c];
}

/* KV heads h0 .. h0 + nh - 1 of a sequence (G query heads each, C * LANES wide; q and out:
 * those heads' rows), block by block: each block's rows are read in address order, all
 * of its heads before the next block. */
static inline __attribute__((always_inline)) void attend_seq_wide(
    const float *restrict q, const void *k_cache, const void *v_cache, int is_bf16,
    const int I8, const int64_t *blocks, int64_t lo, int64_t len, int64_t block_size,
    int64_t row, int64_t hs, int64_t h0, int64_t nh, const int G, const int C, float cap,
    float *restrict out) {
    const int64_t d = C * LANES, heads = nh * G;
    vf qv[heads * C], acc[heads * C];
    float m[heads], l[heads];
    for (int64_t i = 0; i < heads * C; ++i) {
        memcpy(&qv[i], q + LANES * i, sizeof(vf));
        acc[i] = (vf){0};
    }
    for (int64_t i = 0; i < heads; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t nblocks = (len + block_size - 1) / block_size;
    for (int64_t j = lo / block_size; j < nblocks; ++j) {
        /* Keys [lo, len): the first block visited starts at lo's row (a sliding window). */
        const int64_t skip = j * block_size < lo ? lo - j * block_size : 0;
        const int64_t n = (len - j * block_size < block_size ? len - j * block_size
                                                             : block_size) - skip;
        const int64_t base = blocks[j] * block_size * row + skip * row;
        const int64_t next = j + 1 < nblocks ? blocks[j + 1] * block_size * row : -1;
        for (int64_t h = 0; h < nh; ++h) {
            const int64_t off = (h0 + h) * hs;
            attend_block(qv + h * G * C, k_cache, v_cache, is_bf16, I8, n, base + off,
                         next < 0 ? -1 : next + off, row, G, C, cap, acc + h * G * C,
                         m + h * G, l + h * G);
        }
    }
    for (int64_t i = 0; i < heads; ++i) {
        const float inv = 1.0f / l[i];
        for (int c = 0; c < C; ++c) {
            vf o = acc[i * C + c] * inv;
            memcpy(out + i * d + LANES * c, &o, sizeof o);
        }
    }
}

/* Whether paged_decode_wide_seq takes a head dim and group size for a cache kind (the
 * only kernel that reads an int8 cache). Head dim 256 (Gemma) for fp32 and bf16 only: an
 * int8 cache stays at 64 / 128, the shapes kernels/cpu_native.py lets through. */
int paged_decode_wide_takes(int64_t group, int64_t dim, int kind) {
    return (dim == 64 || dim == 128 || (dim == 256 && kind != KV_INT8)) && group >= 1 &&
           group <= 8;
}

/* One compiled copy of attend_seq_wide per literal (I8, G, D), each its own function: all
 * forty inlined into paged_decode_wide_seq made one function so large that GCC took
 * 6-7 minutes over it with -march=native (past the build's time limit, which left the
 * engine on the portable build); apart, they compile in seconds, and the call is once
 * per work item. */
#define SEQ_ARGS                                                                        \
    const float *restrict q, const void *k_cache, const void *v_cache, int is_bf16,    \
        const int64_t *blocks, int64_t lo, int64_t len, int64_t block_size, int64_t row, \
        int64_t hs, int64_t h0, int64_t nh, float cap, float *restrict out
#define DEF_SEQ(I8, G, D)                                                               \
    static __attribute__((noinline)) void seq_##I8##_##G##_##D(SEQ_ARGS) {               \
        attend_seq_wide(q, k_cache, v_cache, is_bf16, I8, blocks, lo, len, block_size,    \
                        row, hs, h0, nh, G, D / LANES, cap, out);                         \
    }
#define DEF_GROUPS(I8, D)                                                               \
    DEF_SEQ(I8, 1, D) DEF_SEQ(I8, 2, D) DEF_SEQ(I8, 3, D) DEF_SEQ(I8, 4, D)            \
    DEF_SEQ(I8, 5, D) DEF_SEQ(I8, 6, D) DEF_SEQ(I8, 7, D) DEF_SEQ(I8, 8, D)
DEF_GROUPS(1, 64)
DEF_GROUPS(1, 128)
DEF_GROUPS(0, 64)
DEF_GROUPS(0, 128)
DEF_GROUPS(0, 256)
#undef DEF_GROUPS
#undef DEF_SEQ
#undef SEQ_ARGS

/* KV heads h0 .. h0 + nh - 1 of one sequence (of num_kv_heads; group query heads each,
 * head dim `dim`), cache element `kind` (vec16.h), over its keys lo .. len - 1 (lo > 0:
 * a sliding window), scores soft-capped at softcap (> 0; 0: none): q and out hold those
 * heads' rows. Returns 0, or 1 for a shape this kernel does not take (nothing written). */
int64_t paged_decode_wide_seq(const float *q, const void *k_cache, const void *v_cache,
                              int kind, const int64_t *blocks, int64_t lo, int64_t len,
                              int64_t block_size, int64_t num_kv_heads, int64_t h0,
                              int64_t nh, int64_t group, int64_t dim, float softcap,
                              float *out) {
    if (!paged_decode_wide_takes(group, dim, kind)) return 1;
    const int i8 = kind == KV_INT8, is_bf16 = kind == KV_BF16;
    const int64_t hs = i8 ? kv_int8_row(dim) : dim, row = num_kv_heads * hs;
#define HEAD(I8, G, D)                                                                  \
    seq_##I8##_##G##_##D(q, k_cache, v_cache, is_bf16, blocks, lo, len, block_size, row, \
                         hs, h0, nh, softcap, out);                                      \
    return 0
#define GROUPS(I8, D)                                              \
    switch (group) {                                               \
        case 1: HEAD(I8, 1, D); case 2: HEAD(I8, 2, D);             \
        case 3: HEAD(I8, 3, D); case 4: HEAD(I8, 4, D);             \
        case 5: HEAD(I8, 5, D); case 6: HEAD(I8, 6, D);             \
        case 7: HEAD(I8, 7, D); default: HEAD(I8, 8, D);            \
    }
    if (i8) {
        if (dim == 64) GROUPS(1, 64);
        GROUPS(1, 128);
    }
    if (dim == 64) GROUPS(0, 64);
    /* Gemma's 256: at 4+ heads a group ~1.5-2x the general kernel's speed, at 1-2 (bound
     * by memory there) no slower (bf16, 2 cores). */
    if (dim == 256) GROUPS(0, 256);
    GROUPS(0, 128);
#undef GROUPS
#undef HEAD
}
