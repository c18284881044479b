/* GGUF Q6_K weights in 16-row groups (gguf_rows16.h) times x: int8 products for a few x
 * rows, and for many rows the group decoded to bf16 once and multiplied with AVX512-BF16.
 * Called by gguf_rows16_matmul (gguf_rows16_cpu.c), which quantizes x and picks.
 *
 * Why two paths: a Q6_K super-block of 256 has a scale per 16 weights (int8) and 6-bit
 * codes (4 low bits in ql, 2 high in qh). With int8 x, each x row pays per 32 weights for
 * two integer sums' scaling on top of the 8 vpdpbusd (the codes' decode is shared by the
 * tile's rows): the fastest at a few rows, but from some tens of rows the per-row scaling
 * loses to the bf16 GEMM over row-major blocks. Decoding each group to bf16 once per call
 * (16 rows x K, ~L2-resident) leaves 16 vdpbf16ps per 32 weights a row and nothing else.
 *
 * Packed (gguf_rows16.h), a super-block's words: 0..31 ql, 32..47 qh, 48..51 the 16 int8
 * scales, 4 a word. Weight 128h + 32t + l (h 0..1, t 0..3, l 0..31) is
 *   d * scale[8h + 2t + l / 16] * (code - 32),
 *   code = (ql byte 64h + 32(t & 1) + l) >> 4(t >> 1) & 15 | (qh byte 32h + l >> 2t & 3) << 4,
 * so quad q (weights 4q..4q+3 of chunk t) is ql word 16h + 8(t & 1) + q, qh word 32 + 8h + q.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gguf_rows16.h"

#ifdef ROWS16_AVX512
/* The 16 rows' codes (0..63, a byte each) of quad q of chunk t of half h. */
static inline __m512i q6k_codes(const __m512i *wv, int h, int t, int q) {
    const __m512i ql = _mm512_loadu_si512(wv + 16 * h + 8 * (t & 1) + q);
    const __m512i qh = _mm512_loadu_si512(wv + 32 + 8 * h + q);
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * (t >> 1)),
                                        _mm512_set1_epi8(0x0F));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * t), _mm512_set1_epi8(3));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
}

/* The 16 rows' int8 scale j (0..15) times d, as fp32. */
static inline __m512 q6k_scale(const __m512i *wv, __m512 d, int j) {
    const __m512i w = _mm512_loadu_si512(wv + 48 + j / 4);
    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * (j % 4)), 24);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
}

/* R int8 x rows against one group. Per chunk of 32 (one x block) and half of 16 (one
 * scale): s = sum of code * x code - 32 * (sum of x codes), started at the latter, then
 * out += (d * scale * dx) * s. */
#define Q6K_KERNEL(R)                                                                     \
    static void q6k_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x,    \
                        void *out, int64_t ldo, int64_t j0, int out_bf16) {               \
        (void)qtype;                                                                      \
        const int64_t bb = 210 * GROUP;                                                   \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                \
            const uint8_t *c = grp + b * bb;                                              \
            const __m512i *wv = (const __m512i *)(c + 32);                                \
            const __m512 d = halves16(c);                                                 \
            for (int h = 0; h < 2; h++)                                                   \
                for (int t = 0; t < 4; t++) {                                             \
                    const int64_t xb = b * 8 + 4 * h + t; /* the x block of the chunk */  \
                    for (int half = 0; half < 2; half++) {                                \
                        const __m512 ds = q6k_scale(wv, d, 8 * h + 2 * t + half);         \
                        __m512i s[R];                                                     \
                        for (int r = 0; r < R; r++)                                       \
                            s[r] = _mm512_set1_epi32(                                     \
                                -32 * x->hx[2 * (r * x->nx + xb) + half]);                \
                        for (int q = 4 * half; q < 4 * half + 4; q++) {                   \
                            const __m512i w = q6k_codes(wv, h, t, q);                     \
                            for (int r = 0; r < R; r++)                                   \
                                s[r] = _mm512_dpbusd_epi32(                               \
                                    s[r], w, _mm512_set1_epi32(x->q[r * x->ldq + xb * 8 + q]));\
                        }                                                                 \
                        for (int r = 0; r < R; r++)                                       \
                            acc[r] = _mm512_fmadd_ps(                                     \
                                _mm512_cvtepi32_ps(s[r]),                                 \
                                _mm512_mul_ps(ds, _mm512_set1_ps(x->dx[r * x->nx + xb])), \
                                acc[r]);                                                  \
                    }                                                                     \
                }                                                                         \
        }                                                                                 \
        for (int r = 0; r < R; r++) store16(out, r * ldo + j0, acc[r], out_bf16);         \
    }
Q6K_KERNEL(1)
Q6K_KERNEL(2)
Q6K_KERNEL(3)
Q6K_KERNEL(4)
Q6K_KERNEL(5)
Q6K_KERNEL(6)
Q6K_KERNEL(7)
Q6K_KERNEL(8)
#undef Q6K_KERNEL

group_fn *const Q6K_FNS[XR + 1] = {NULL, q6k_1, q6k_2, q6k_3, q6k_4, q6k_5, q6k_6, q6k_7,
                                   q6k_8};

#ifdef __AVX512BF16__
/* One group's nb super-blocks -> scratch [16 k / 32 vectors of 64 bytes]: vector p holds
 * weights 2p and 2p + 1 of the 16 rows, a pair of bf16 to a 32-bit lane (the order
 * vdpbf16ps reads). */
static void q6k_to_bf16(const uint8_t *grp, int64_t nb, uint16_t *scratch) {
    /* word 2i <- word i (the even weights' bf16), 2i + 1 <- word 16 + i (the odd ones') */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                           25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                           18, 2, 17, 1, 16, 0);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    __m512i *dst = (__m512i *)scratch;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = grp + b * 210 * GROUP;
        const __m512i *wv = (const __m512i *)(c + 32);
        const __m512 d = halves16(c);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int half = 0; half < 2; half++) {
                    const __m512 ds = q6k_scale(wv, d, 8 * h + 2 * t + half);
                    const __m512 off = _mm512_mul_ps(ds, _mm512_set1_ps(-32.0f));
                    for (int q = 4 * half; q < 4 * half + 4; q++) {
                        const __m512i w = q6k_codes(wv, h, t, q);
                        __m512 v[4];
                        for (int j = 0; j < 4; j++)
                            v[j] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(_mm512_and_si512(
                                    _mm512_srli_epi32(w, 8 * j), byte)), ds, off);
                        /* weights 4q.. of the chunk: pair vectors (128h + 32t + 4q) / 2 */
                        __m512i *p = dst + (b * 256 + 128 * h + 32 * t + 4 * q) / 2;
                        _mm512_storeu_si512(p, _mm512_permutexvar_epi16(
                            pairs, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0])));
                        _mm512_storeu_si512(p + 1, _mm512_permutexvar_epi16(
                            pairs, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2])));
                    }
                }
    }
}

/* R bf16 x rows (ldx apart) against a decoded group of k / 2 pair vectors. */
#define BF16_TILE(R)                                                                      \
    static void bf16_tile_##R(const __m512i *wv, int64_t pairs, const uint16_t *x,        \
                              int64_t ldx, void *out, int64_t ldo, int64_t j0,            \
                              int out_bf16) {                                             \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int64_t p = 0; p < pairs; p++) {                                             \
            const __m512bh w = (__m512bh)_mm512_loadu_si512(wv + p);                      \
            for (int r = 0; r < R; r++) {                                                 \
                int32_t xp;                                                               \
                __builtin_memcpy(&xp, x + r * ldx + 2 * p, 4);                            \
                acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(xp));    \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) store16(out, r * ldo + j0, acc[r], out_bf16);         \
    }
BF16_TILE(1)
BF16_TILE(2)
BF16_TILE(3)
BF16_TILE(4)
BF16_TILE(5)
BF16_TILE(6)
BF16_TILE(7)
BF16_TILE(8)
#undef BF16_TILE

typedef void tile_fn(const __m512i *, int64_t, const uint16_t *, int64_t, void *, int64_t,
                     int64_t, int);
static tile_fn *const BF16_TILES[XR + 1] = {NULL, bf16_tile_1, bf16_tile_2, bf16_tile_3,
                                            bf16_tile_4, bf16_tile_5, bf16_tile_6,
                                            bf16_tile_7, bf16_tile_8};
#endif

/* x [m, k] (fp32 rows rounded to bf16 first; bf16 as they are) @ W.T for a packed Q6_K
 * W [n, k]: each thread decodes one group at a time to bf16 (16 k / 2 pair vectors,
 * L2-resident) and runs every x row over it. Returns 0 or NO_MEMORY. */
int64_t rows16_q6k_bf16_matmul(const void *x, int64_t m, int64_t k, int64_t ldx,
                               int32_t x_bf16, const uint8_t *w, int64_t n, void *out,
                               int64_t ldo, int32_t out_bf16, int32_t threads) {
#ifdef __AVX512BF16__
    const int64_t nb = k / 256, groups = n / GROUP;
    const size_t os = out_bf16 ? 2 : 4;
    const uint16_t *xb = x;
    uint16_t *rounded = NULL;
    if (!x_bf16) {
        rounded = malloc((size_t)(m * k) * 2);
        if (!rounded) return NO_MEMORY;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i += 16)
                _mm256_storeu_si256((__m256i *)(rounded + r * k + i),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(
                                        (const float *)x + r * ldx + i)));
        xb = rounded;
        ldx = k;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint16_t *scratch = aligned_alloc(64, (size_t)(GROUP * k) * 2);
        failed = scratch == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            q6k_to_bf16(w + g * GROUP * nb * 210, nb, scratch);
            for (int64_t r = 0; r < m; r += XR) {
                const int64_t cnt = m - r < XR ? m - r : XR;
                BF16_TILES[cnt]((const __m512i *)scratch, nb * 128, xb + r * ldx, ldx,
                                (char *)out + (size_t)(r * ldo) * os, ldo, g * GROUP,
                                out_bf16);
            }
        }
        free(scratch);
    }
    free(rounded);
    return failed ? NO_MEMORY : 0;
#else /* not called: gguf_rows16_types() leaves Q6_K out of such builds */
    (void)x; (void)m; (void)k; (void)ldx; (void)x_bf16; (void)w; (void)n; (void)out;
    (void)ldo; (void)out_bf16; (void)threads;
    return BAD_TYPE;
#endif
}
#endif /* ROWS16_AVX512 */
