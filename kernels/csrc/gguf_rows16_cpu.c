/* GGUF weights repacked in groups of 16 rows (gguf_rows16.h; packed by
 * gguf_rows16_pack.c) times int8-quantized activations (AVX512-VNNI), for any number of
 * x rows: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K here, Q6_K in gguf_rows16_q6k.c;
 * and the product's driver, which AVX2 builds share (their kernels and x quantizer:
 * gguf_rows16_avx2.c). Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: the row-major blocks make every product pay for a layout change. The int8 GEMV
 * sums each row's lanes at the end of each dot product, and the bf16 GEMM decodes each
 * panel to bf16 and transposes it to pair-interleaved order, per call: at 8 rows of the
 * default model that is ~45% of the step. Here the bytes are rearranged once, at load,
 * so that one 64-byte load holds four codes of each of 16 rows side by side (a 32-bit
 * lane per row): vpdpbusd with four x codes broadcast adds 64 products into the 16
 * outputs at once. Per block, per x row, the integer sums are scaled into fp32 outputs
 * (d * dx) and the offset term added (m * dx * sum of x codes). No lane sums, no decode
 * tables, no transposes per call; a weight is read as stored, 4.5-8.5 bits.
 *
 * Numbers: x is quantized per block of 32 to int8 codes with one fp32 scale dx (round to
 * nearest, as gguf_int8_cpu.c), products summed exactly in int32 per block, then
 * out += (d * dx) * sum + m * (dx * sum of codes) in fp32, block by block, for Q4_1's and
 * Q5_1's offset m (Q4_K, Q5_K: d * scale_j and -dmin * min_j per sub-block j). A fixed
 * offset o (-8 for Q4_0, -16 for Q5_0, -128 for Q8_0's unsigned codes) is summed in the
 * integers instead: out += (d * dx) * (sum + o * sum of codes), one fp32 step less per
 * block and x row (1.23x for Q8_0, 1.07x for Q4_0/Q5_0 at 64-128 rows).
 *   x [M, K] float32 or bfloat16 (x_bf16), rows ldx apart; w [N, row_bytes] packed, N a
 *   multiple of 16, rows contiguous; out [M, N] float32 or bfloat16 (out_bf16), ldo apart.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_rows16.h"

#ifdef ROWS16_AVX512
static inline __m512 load16(const void *x, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* gguf_rows16.h says what it writes. */
void rows16_quantize_row(const void *x, int bf16, int64_t nx, int8_t *q, float *dx,
                         float *sx, int32_t *hx) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < nx; b++) {
        __m512 v0 = load16(x, b * 32, bf16), v1 = load16(x, b * 32 + 16, bf16);
        __m512 a = _mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign));
        float amax = _mm512_reduce_max_ps(a);
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(c1));
        const __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        dx[b] = nan ? __builtin_nanf("") : amax / 127.0f; /* NaN x: NaN out (int8_cpu.c) */
        hx[2 * b] = _mm512_reduce_add_epi32(c0);
        hx[2 * b + 1] = _mm512_reduce_add_epi32(c1);
        sx[b] = dx[b] * (float)(hx[2 * b] + hx[2 * b + 1]);
    }
}

/* acc[r] += (scale * dx_r) * sum_r + offset * s_r over R rows: one block's integer sums
 * into the fp32 outputs (s: dx times the x codes' sum over the block). */
#define SCALE_INTO(R, acc, sum, scale, offset, dxp, sp)                                   \
    for (int r = 0; r < R; r++) {                                                         \
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]),                              \
                                 _mm512_mul_ps(scale, _mm512_set1_ps((dxp)[r])), acc[r]);  \
        acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps((sp)[r]), acc[r]);               \
    }

/* R x rows against one packed row group of a 32-weight type: 16 outputs a row into out
 * at j0 (rows ldo apart). `five` (a constant in each instance): Q5_0 and Q5_1, Q4_0's and
 * Q4_1's nibbles plus a fifth bit a weight from the row's qh word (bit j: weight j), the
 * first word vector. vpshufb spreads qh byte e of each lane over its four bytes (rep[e]);
 * byte j of quad v's low codes takes bit 4(v & 1) + j of byte v / 2, its high codes the
 * same bit of byte 2 + v / 2, added as 16 where set (a mask test). */
#define GROUP_KERNEL(R, name, five)                                                       \
    static void name##_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x, \
                           void *out, int64_t ldo, int64_t j0, int out_bf16) {            \
        layout l;                                                                         \
        layout_of(qtype, &l);                                                             \
        const int64_t bb = l.bytes * GROUP;                                               \
        const int q8 = qtype == Q8_0, has_m = qtype == Q4_1 || qtype == Q5_1;             \
        const float off = q8 ? -128.0f : (five) ? -16.0f : -8.0f;                         \
        const __m512i nib = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);       \
        const __m512i lanes = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);   \
        const __m512i sel[2] = {_mm512_set1_epi32(0x08040201),                            \
                                _mm512_set1_epi32((int)0x80402010)};                      \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                \
            const uint8_t *c = grp + b * bb;                                              \
            __m512 d = halves16(c);                                                       \
            const __m512 m = has_m ? halves16(c + 32) : d;                                \
            const uint8_t *qs = c + 32 * l.halves + ((five) ? 64 : 0);                    \
            __m512i rep[4];                                                               \
            if (five)                                                                     \
                for (int e = 0; e < 4; e++)                                               \
                    rep[e] = _mm512_shuffle_epi8(_mm512_loadu_si512(qs - 64),             \
                                                 _mm512_add_epi8(lanes,                   \
                                                                 _mm512_set1_epi8((char)e)));\
            __m512i s[R];                                                                 \
            float dxs[R], sxs[R];                                                         \
            for (int r = 0; r < R; r++) {                                                 \
                /* a fixed offset (all but Q4_1, Q5_1) summed in integers: off * codes */ \
                const int32_t *h = x->hx + 2 * (r * x->nx + b);                           \
                s[r] = has_m ? _mm512_setzero_si512()                                     \
                             : _mm512_set1_epi32((int32_t)off * (h[0] + h[1]));           \
                dxs[r] = x->dx[r * x->nx + b];                                            \
                sxs[r] = x->sx[r * x->nx + b];                                            \
            }                                                                             \
            if (q8) {                                                                     \
                for (int v = 0; v < 8; v++) {                                             \
                    __m512i w = _mm512_loadu_si512(qs + 64 * v);                          \
                    for (int r = 0; r < R; r++)                                           \
                        s[r] = _mm512_dpbusd_epi32(                                       \
                            s[r], w, _mm512_set1_epi32(x->q[r * x->ldq + b * 8 + v]));    \
                }                                                                         \
            } else {                                                                      \
                for (int v = 0; v < 4; v++) {                                             \
                    __m512i w = _mm512_loadu_si512(qs + 64 * v);                          \
                    __m512i lo = _mm512_and_si512(w, nib);                                \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);          \
                    if (five) {                                                           \
                        const __m512i bit = sel[v & 1];                                   \
                        lo = _mm512_mask_add_epi8(                                        \
                            lo, _mm512_test_epi8_mask(rep[v >> 1], bit), lo, fifth);      \
                        hi = _mm512_mask_add_epi8(                                        \
                            hi, _mm512_test_epi8_mask(rep[2 + (v >> 1)], bit), hi, fifth);\
                    }                                                                     \
                    for (int r = 0; r < R; r++) {                                         \
                        const int32_t *xb = x->q + r * x->ldq + b * 8;                    \
                        s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(xb[v]));   \
                        s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(xb[v + 4]));\
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            if (has_m) {                                                                  \
                SCALE_INTO(R, acc, s, d, m, dxs, sxs)                                     \
            } else {                                                                      \
                for (int r = 0; r < R; r++)                                               \
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]),                    \
                                             _mm512_mul_ps(d, _mm512_set1_ps(dxs[r])),    \
                                             acc[r]);                                     \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) store16(out, r * ldo + j0, acc[r], out_bf16);         \
    }

/* Q4_K and Q5_K: per super-block of 256, eight sub-blocks of 32 with 6-bit scales and
 * mins (the 12 bytes as three word vectors S0..S2, the 16 rows' in lanes). Sub-block
 * j < 4: scale S0 byte j, min S1 byte j (low 6 bits); j >= 4: S2 byte j-4's low / high
 * nibble, with the top two bits of S0 / S1 byte j-4 as bits 4-5. Codes: word `at` + 8c + q
 * holds quad q of sub-blocks 2c (low nibbles) and 2c + 1 (high), `at` 3 for Q4_K; Q5_K
 * has 8 qh words first (word 3 + q: byte l's bit j, weight 4q + l's fifth bit in
 * sub-block j), so `at` 11. (Q6_K: gguf_rows16_q6k.c.) */
#define KQ_KERNEL(R, name, fifth)                                                         \
    static void name##_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x, \
                           void *out, int64_t ldo, int64_t j0, int out_bf16) {            \
        layout l;                                                                         \
        layout_of(qtype, &l);                                                             \
        const int64_t bb = l.bytes * GROUP;                                               \
        const __m512i nib = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi32(63);          \
        const __m512i low4 = _mm512_set1_epi32(15), top2 = _mm512_set1_epi32(3 << 4);     \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                \
            const uint8_t *c = grp + b * bb;                                              \
            const __m512i *wv = (const __m512i *)(c + 32 * l.halves);                     \
            const __m512 d = halves16(c);                                                 \
            const __m512 neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves16(c + 32)); \
            const __m512i s0 = _mm512_loadu_si512(wv), s1 = _mm512_loadu_si512(wv + 1);   \
            const __m512i s2 = _mm512_loadu_si512(wv + 2);                                \
            __m512i s[R];                                                                 \
            float dxs[R], sxs[R];                                                         \
            for (int j = 0; j < 8; j++) {                                                 \
                const int jb = 8 * (j & 3);                                               \
                __m512i sc, mn;                                                           \
                if (j < 4) {                                                              \
                    sc = _mm512_and_si512(_mm512_srli_epi32(s0, jb), six);                \
                    mn = _mm512_and_si512(_mm512_srli_epi32(s1, jb), six);                \
                } else {                                                                  \
                    const __m512i e = _mm512_srli_epi32(s2, jb);                          \
                    sc = _mm512_or_si512(_mm512_and_si512(e, low4),                       \
                                         _mm512_and_si512(_mm512_srli_epi32(s0, jb + 2), top2));\
                    mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(e, 4), low4), \
                                         _mm512_and_si512(_mm512_srli_epi32(s1, jb + 2), top2));\
                }                                                                         \
                const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));            \
                const __m512 offset = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn));    \
                const int64_t xb = b * 8 + j; /* the x block of sub-block j */            \
                for (int r = 0; r < R; r++) {                                             \
                    s[r] = _mm512_setzero_si512();                                        \
                    dxs[r] = x->dx[r * x->nx + xb];                                       \
                    sxs[r] = x->sx[r * x->nx + xb];                                       \
                }                                                                         \
                for (int q = 0; q < 8; q++) {                                             \
                    __m512i w = _mm512_loadu_si512(wv + 3 + 8 * fifth + 8 * (j >> 1) + q); \
                    w = _mm512_and_si512((j & 1) ? _mm512_srli_epi16(w, 4) : w, nib);     \
                    if (fifth) {                                                          \
                        const __m512i h = _mm512_loadu_si512(wv + 3 + q);                 \
                        w = _mm512_or_si512(w, _mm512_and_si512(                          \
                            j <= 4 ? _mm512_slli_epi16(h, 4 - j)                          \
                                   : _mm512_srli_epi16(h, j - 4),                         \
                            _mm512_set1_epi8(0x10)));                                     \
                    }                                                                     \
                    for (int r = 0; r < R; r++)                                           \
                        s[r] = _mm512_dpbusd_epi32(                                       \
                            s[r], w, _mm512_set1_epi32(x->q[r * x->ldq + xb * 8 + q]));   \
                }                                                                         \
                SCALE_INTO(R, acc, s, scale, offset, dxs, sxs)                            \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) store16(out, r * ldo + j0, acc[r], out_bf16);         \
    }

#define ALL_KERNELS(R)                                                                    \
    GROUP_KERNEL(R, group, 0)                                                             \
    GROUP_KERNEL(R, q5, 1) KQ_KERNEL(R, q4k, 0) KQ_KERNEL(R, q5k, 1)
ALL_KERNELS(1)
ALL_KERNELS(2)
ALL_KERNELS(3)
ALL_KERNELS(4)
ALL_KERNELS(5)
ALL_KERNELS(6)
ALL_KERNELS(7)
ALL_KERNELS(8)
#undef ALL_KERNELS
#undef KQ_KERNEL
#undef GROUP_KERNEL
#undef SCALE_INTO
static group_fn *const GROUP_FNS[XR + 1] = {NULL, group_1, group_2, group_3, group_4,
                                            group_5, group_6, group_7, group_8};
static group_fn *const Q4K_FNS[XR + 1] = {NULL, q4k_1, q4k_2, q4k_3, q4k_4, q4k_5, q4k_6,
                                          q4k_7, q4k_8};
static group_fn *const Q5K_FNS[XR + 1] = {NULL, q5k_1, q5k_2, q5k_3, q5k_4, q5k_5, q5k_6,
                                          q5k_7, q5k_8};
static group_fn *const Q5_FNS[XR + 1] = {NULL, q5_1, q5_2, q5_3, q5_4, q5_5, q5_6, q5_7,
                                         q5_8};

group_fn *const *rows16_kernels(int32_t qtype) {
    return qtype == Q4_K                   ? Q4K_FNS
           : qtype == Q5_K                 ? Q5K_FNS
           : qtype == Q6_K                 ? Q6K_FNS
           : qtype == Q5_0 || qtype == Q5_1 ? Q5_FNS
                                            : GROUP_FNS;
}
#endif /* ROWS16_AVX512 */

/* Q6_K from this many x rows takes the bf16 path (gguf_rows16_q6k.c). Measured by A/B of
 * two builds in one process (bf16 / int8 time): at 576 x 1536 (SmolLM2's ffn_down) 1.25
 * at 8 rows, 0.87 at 12, 0.78 at 16, 0.59 at 64; at 12288 x 2304 1.2 at 8, 1.04 at 12,
 * about 1 from 16 to 48. */
#ifndef Q6K_BF16_MIN_M /* -D to measure another */
#define Q6K_BF16_MIN_M 12
#endif

/* x codes a chunk of rows holds at most (many x rows; see gguf_rows16_matmul). */
#ifndef X_CHUNK_BYTES
#define X_CHUNK_BYTES (256 << 10)
#endif

/* The x rows from which `qtype` takes a bf16 path rather than int8 products; 0: never. */
int64_t gguf_rows16_bf16_min_m(int32_t qtype) {
#if defined(ROWS16_AVX512) && defined(__AVX512BF16__)
    return qtype == Q6_K ? Q6K_BF16_MIN_M : 0;
#else
    (void)qtype;
    return 0;
#endif
}

/* x [m, k] @ W.T for W [n, k] packed as above -> out [m, n]. Returns 0, BAD_TYPE,
 * BAD_SHAPE, NO_MEMORY, or BAD_TYPE for a type without a kernel in this build (every
 * type without AVX2). */
int64_t gguf_rows16_matmul(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                           const uint8_t *w, int64_t n, int32_t qtype, void *out, int64_t ldo,
                           int32_t out_bf16, int32_t threads) {
#ifndef HAVE_ROWS16
    (void)x; (void)m; (void)k; (void)ldx; (void)x_bf16; (void)w; (void)n; (void)qtype;
    (void)out; (void)ldo; (void)out_bf16; (void)threads;
    return BAD_TYPE;
#else
    int64_t nb, bb, rc = geometry(qtype, n, k, &nb, &bb);
    if (rc) return rc;
    if (m <= 0) return 0;
    if (!((gguf_rows16_types() >> qtype) & 1)) return BAD_TYPE;
#ifdef ROWS16_AVX512
    if (qtype == Q6_K && m >= Q6K_BF16_MIN_M)
        return rows16_q6k_bf16_matmul(x, m, k, ldx, x_bf16, w, n, out, ldo, out_bf16,
                                      threads);
#endif
    const int64_t nx = k / 32, ldq = k / 4, groups = n / GROUP;
    const size_t es = x_bf16 ? 2 : 4;
    int8_t *q = aligned_alloc(64, ((size_t)(m * k) + 63) / 64 * 64);
    float *dx = malloc((size_t)(4 * m * nx) * sizeof(float)); /* dx, sx, then hx */
    if (!q || !dx) {
        free(q);
        free(dx);
        return NO_MEMORY;
    }
    float *sx = dx + m * nx;
    int32_t *hx = (int32_t *)(sx + m * nx);
    group_fn *const *fns = rows16_kernels(qtype);
    const size_t os = out_bf16 ? 2 : 4;
    /* One parallel region a call (a decode step makes ~120 of these calls): every x row
     * quantized once, up front (codes, then per row and block dx and sx), then the row
     * groups split over the threads, each running x rows over its groups (a group read
     * from L1 or L2 for every 8 x rows after the first). Many x rows (a prefill) go in
     * chunks of X_CHUNK_BYTES of codes, each thread running its groups over a chunk
     * before the next: a chunk stays in its L2 while the thread's share of the weight is
     * read again per chunk, instead of all of x streamed from L3 once per group. The
     * static schedule gives a thread the same groups in every chunk, so no barrier.
     * (XR: 8 x rows a call with AVX-512, 4 with AVX2.) */
    const int64_t tiles = X_CHUNK_BYTES / k / XR; /* 8-row tiles a chunk */
    const int64_t chunk = tiles > 0 ? tiles * XR : XR;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            rows16_quantize_row((const char *)x + (size_t)(r * ldx) * es, x_bf16, nx,
                                q + r * k, dx + r * nx, sx + r * nx, hx + 2 * r * nx);
        for (int64_t r0 = 0; r0 < m; r0 += chunk) {
            const int64_t r1 = m - r0 < chunk ? m : r0 + chunk;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *grp = w + g * GROUP * nb * bb;
                for (int64_t r = r0; r < r1; r += XR) {
                    const int64_t cnt = r1 - r < XR ? r1 - r : XR;
                    const xrows xr = {(const int32_t *)q + r * ldq, dx + r * nx,
                                      sx + r * nx, hx + 2 * r * nx, ldq, nx};
                    fns[cnt](grp, qtype, nb, &xr, (char *)out + (size_t)(r * ldo) * os,
                             ldo, g * GROUP, out_bf16);
                }
            }
        }
    }
    free(q);
    free(dx);
    return 0;
#endif
}
