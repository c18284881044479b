/* GGUF block weights times bfloat16 activations, for M >= 4 rows (batched decode,
 * prefill), on CPUs with AVX512-BF16; and plain bf16 weights (dense_gemm_bf16_cpu) for
 * any M, read where they lie. Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: the large-M path used to decode a whole weight into a bf16 tile and hand it to
 * torch's BLAS. That decode is as long as the GEMM itself at a few rows, and the tile of a
 * large weight (a 49152-row head: 56 MB) leaves the caches before the BLAS reads it back.
 * Here each thread decodes PANEL weight rows into a bf16 panel that stays in L1/L2, then
 * multiplies every x row against it (vdpbf16ps: 32 bf16 products summed into 16 fp32
 * lanes per instruction): from OUTER_MIN_M (8) rows as outer products over a pair-interleaved
 * panel (vnni_times_x), below that as dot products (panel_times_x). A weight is read as
 * stored, 4-8 bits, once per call.
 *
 * Numbers: the weights are rounded to bf16 once, exactly as the tile path rounds them;
 * products are exact in fp32 and summed in fp32, in lane order rather than a BLAS's, so
 * results agree with the tile path to fp32 rounding of the sums.
 *
 *   x    [M, K]    bfloat16, rows `ldx` elements apart (K: whole blocks, so whole 32s)
 *   w    [N, row]  uint8 blocks (layouts as in kernels/gguf_blocks.py), rows `ldw` bytes
 *   out  [M, N]    float32, or bfloat16 when out_bf16, rows `ldo` elements apart
 * Returns 0, BAD_TYPE / BAD_SHAPE as gguf_cpu.c, NO_MEMORY, or NO_KERNEL when this build
 * has no AVX512-BF16 (the caller takes the tile path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_GEMM 1
#endif

#define NO_MEMORY 3
#define NO_KERNEL 4

int64_t gguf_decode_rows_bf16(const uint8_t *w, int64_t n, int64_t k, int64_t ldw,
                              int32_t qtype, uint16_t *out, int64_t ldo, float *row);

/* 1 where this build has the kernel (the CPU it was built for has AVX512-BF16). */
int64_t gguf_gemm_bf16_available(void) {
#ifdef HAVE_BF16_GEMM
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_BF16_GEMM
#define PANEL 32 /* weight rows a thread decodes at a time: 32 x K bf16 stays in L1/L2 */
#define WR 4     /* weight rows per micro-kernel call */
#define XR 6     /* x rows per micro-kernel call: 6 x 4 accumulators + 4 weights + 1 x */
#define PF 8 /* weight rows ahead that a dense weight's micro-kernel asks for */

/* The lane sums of four accumulators: [sum a0, sum a1, sum a2, sum a3]. */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* R x rows (ldx apart) against WR weight rows (ldw apart): res[r] holds the WR dot
 * products of x row r. Written out per R so the accumulators live in registers. `pf`
 * rows ahead are requested as these are read: PF for a weight read from memory, 0 (the
 * lines being read, already in cache) for a decoded panel. */
#define MICRO_KERNEL(R)                                                                   \
    static void micro_##R(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, \
                          int64_t k, int64_t pf, __m128 *res) {                           \
        __m512 acc[R][WR];                                                                \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < WR; c++) acc[r][c] = _mm512_setzero_ps();                 \
        for (int64_t i = 0; i < k; i += 32) {                                             \
            for (int c = 0; c < WR; c++)                                                  \
                _mm_prefetch((const char *)(w + (pf + c) * ldw + i), _MM_HINT_T0);        \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i);                            \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + ldw + i);                      \
            __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2 * ldw + i);                  \
            __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3 * ldw + i);                  \
            for (int r = 0; r < R; r++) {                                                 \
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + i);              \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);                          \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);                          \
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);                          \
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);                          \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            res[r] = reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);                 \
    }
MICRO_KERNEL(1)
MICRO_KERNEL(2)
MICRO_KERNEL(3)
MICRO_KERNEL(4)
MICRO_KERNEL(5)
MICRO_KERNEL(6)
#undef MICRO_KERNEL

static inline uint16_t to_bf16(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* cols (1..4) results of one x row into out at `at` (bf16: rounded to nearest even, as
 * to_bf16, in one instruction for a full group). */
static inline void store(void *out, int64_t at, __m128 v, int64_t cols, int out_bf16) {
    if (cols == WR) {
        if (out_bf16)
            _mm_storel_epi64((__m128i *)((uint16_t *)out + at), (__m128i)_mm_cvtneps_pbh(v));
        else
            _mm_storeu_ps((float *)out + at, v);
        return;
    }
    float f[4];
    _mm_storeu_ps(f, v);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t c = 0; c < cols; c++) o[c] = to_bf16(f[c]);
    } else {
        memcpy((float *)out + at, f, (size_t)cols * sizeof(float));
    }
}

/* Every x row against one panel of `rows` bf16 weight rows `ldp` elements apart (padded
 * with zero rows to a multiple of WR), written to out columns j0...; `pf` as for the
 * micro-kernels. */
static void panel_times_x(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                          const uint16_t *panel, int64_t ldp, int64_t rows, int64_t pf,
                          int64_t j0, void *out, int64_t ldo, int out_bf16) {
    for (int64_t r = 0; r < m; r += XR) {
        int64_t cnt = m - r < XR ? m - r : XR;
        const uint16_t *xr = x + r * ldx;
        for (int64_t c = 0; c < rows; c += WR) {
            __m128 res[XR];
            const uint16_t *wc = panel + c * ldp;
            switch (cnt) {
            case 6: micro_6(xr, ldx, wc, ldp, k, pf, res); break;
            case 5: micro_5(xr, ldx, wc, ldp, k, pf, res); break;
            case 4: micro_4(xr, ldx, wc, ldp, k, pf, res); break;
            case 3: micro_3(xr, ldx, wc, ldp, k, pf, res); break;
            case 2: micro_2(xr, ldx, wc, ldp, k, pf, res); break;
            default: micro_1(xr, ldx, wc, ldp, k, pf, res); break;
            }
            int64_t cols = rows - c < WR ? rows - c : WR;
            for (int64_t i = 0; i < cnt; i++)
                store(out, (r + i) * ldo + j0 + c, res[i], cols, out_bf16);
        }
    }
}

/* The GGUF path multiplies a decoded panel as outer products: the panel is stored
 * pair-interleaved ("VNNI" layout: for each pair of k, the PANEL rows' two weights side
 * by side, 2 x 16 rows a 512-bit vector), so one vdpbf16ps with an x pair broadcast adds
 * that pair's products into 16 output columns at once. The accumulators are the outputs
 * themselves: no horizontal sums per call, which in the dot-product form above cost a
 * third of the work at K = 576 (18 steps per 4 x 6 sums). */
#define OR 12 /* x rows per outer micro-kernel: 12 x 2 accumulators + 2 weight vectors */
/* Below this many x rows the interleave costs more than the horizontal sums it saves.
 * Measured at SmolLM2's five shapes against oneDNN's packed bf16 in the same run: from 8
 * rows the outer form's ratio is lower than the dot form's (8 rows: 0.85-2.1x vs
 * 1.5-2.2x; 64 rows: 1.0-1.3x vs 1.2-1.6x). */
#define OUTER_MIN_M 8

/* `rows` (<= PANEL) decoded row-major bf16 rows of `k` (ldp apart; k a multiple of 32,
 * so the pairs are whole 16s) into `vnni` [k / 2][PANEL][2], zero for rows past `rows`:
 * 16 x 16 transposes of the rows' 32-bit pairs (unpacks, then 128-bit lane shuffles). */
static void interleave(const uint16_t *panel, int64_t ldp, int64_t rows, int64_t k,
                       uint32_t *vnni) {
    const int64_t pairs = k / 2;
    for (int64_t g = 0; g < PANEL; g += 16) {
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            __m512i r[16], t[16];
            for (int i = 0; i < 16; i++)
                r[i] = g + i < rows ? _mm512_loadu_si512(panel + (g + i) * ldp + 2 * p0)
                                    : _mm512_setzero_si512();
            for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3 */
                t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int i = 0; i < 16; i += 4) { /* r[i + c]: column c of rows i..i+3, a lane */
                r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
                r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
                r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
                r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            for (int c = 0; c < 4; c++) { /* lane L of r[c], r[4+c], r[8+c], r[12+c] */
                __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
                __m512i b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
                __m512i a2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
                __m512i b2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
                t[c] = _mm512_shuffle_i32x4(a, b, 0x88);
                t[4 + c] = _mm512_shuffle_i32x4(a, b, 0xDD);
                t[8 + c] = _mm512_shuffle_i32x4(a2, b2, 0x88);
                t[12 + c] = _mm512_shuffle_i32x4(a2, b2, 0xDD);
            }
            for (int j = 0; j < 16; j++)
                _mm512_storeu_si512(vnni + (p0 + j) * PANEL + g, t[j]);
        }
    }
}

/* 32 output columns (rows of the panel) of one x row, from two accumulators. */
static inline void store32(void *out, int64_t at, __m512 lo, __m512 hi, int64_t cols,
                           int out_bf16) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1u);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF
                         : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1u);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + at;
        _mm256_mask_storeu_epi16(o, m0, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_mask_storeu_epi16(o + 16, m1, (__m256i)_mm512_cvtneps_pbh(hi));
    } else {
        float *o = (float *)out + at;
        _mm512_mask_storeu_ps(o, m0, lo);
        _mm512_mask_storeu_ps(o + 16, m1, hi);
    }
}

#define OUTER_KERNEL(R)                                                                   \
    static void outer_##R(const uint16_t *x, int64_t ldx, const uint32_t *vnni,          \
                          int64_t pairs, void *out, int64_t ldo, int64_t cols,           \
                          int out_bf16) {                                                \
        __m512 lo[R], hi[R];                                                              \
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();                  \
        const uint32_t *xp = (const uint32_t *)x;                                         \
        const int64_t ldx2 = ldx / 2;                                                     \
        for (int64_t p = 0; p < pairs; p++) {                                             \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(vnni + p * PANEL);                 \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(vnni + p * PANEL + 16);            \
            for (int r = 0; r < R; r++) {                                                 \
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[r * ldx2 + p]);         \
                lo[r] = _mm512_dpbf16_ps(lo[r], xb, w0);                                  \
                hi[r] = _mm512_dpbf16_ps(hi[r], xb, w1);                                  \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            store32(out, r * ldo, lo[r], hi[r], cols, out_bf16);                          \
    }
OUTER_KERNEL(1)
OUTER_KERNEL(2)
OUTER_KERNEL(3)
OUTER_KERNEL(4)
OUTER_KERNEL(5)
OUTER_KERNEL(6)
OUTER_KERNEL(7)
OUTER_KERNEL(8)
OUTER_KERNEL(9)
OUTER_KERNEL(10)
OUTER_KERNEL(11)
OUTER_KERNEL(12)
#undef OUTER_KERNEL

/* Every x row against one interleaved panel, into out columns j0 .. j0 + cols. */
static void vnni_times_x(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                         const uint32_t *vnni, int64_t cols, int64_t j0, void *out,
                         int64_t ldo, int out_bf16) {
    const int64_t pairs = k / 2;
    for (int64_t r = 0; r < m; r += OR) {
        const int64_t cnt = m - r < OR ? m - r : OR;
        const uint16_t *xr = x + r * ldx;
        const size_t esz = out_bf16 ? 2 : 4;
        void *o = (char *)out + (size_t)(r * ldo + j0) * esz;
        switch (cnt) {
        case 12: outer_12(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 11: outer_11(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 10: outer_10(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 9: outer_9(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 8: outer_8(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 7: outer_7(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 6: outer_6(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 5: outer_5(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 4: outer_4(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 3: outer_3(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        case 2: outer_2(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        default: outer_1(xr, ldx, vnni, pairs, o, ldo, cols, out_bf16); break;
        }
    }
}
#endif

int64_t gguf_gemm_bf16_cpu(const void *xv, int64_t m, int64_t k, int64_t ldx,
                           const uint8_t *w, int64_t n, int64_t ldw, int32_t qtype,
                           void *out, int64_t ldo, int32_t out_bf16, int32_t threads) {
#ifndef HAVE_BF16_GEMM
    (void)xv; (void)m; (void)k; (void)ldx; (void)w; (void)n; (void)ldw; (void)qtype;
    (void)out; (void)ldo; (void)out_bf16; (void)threads;
    return NO_KERNEL;
#else
    /* The type and K are checked by the decoder (no rows decoded). */
    const uint16_t *x = xv;
    int64_t rc = gguf_decode_rows_bf16(w, 0, k, ldw, qtype, NULL, 0, NULL);
    if (rc) return rc;
    if (k % 32) return 2; /* every block type is whole 32s, so check() already refused */
    int64_t groups = (n + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* k is a multiple of 32, so every panel row starts 64-byte aligned. */
        uint16_t *panel = aligned_alloc(64, (size_t)(PANEL * k) * sizeof(uint16_t));
        uint32_t *vnni = aligned_alloc(64, (size_t)(PANEL * k / 2) * sizeof(uint32_t));
        float *row = aligned_alloc(64, (size_t)k * sizeof(float));
        failed = panel == NULL || vnni == NULL || row == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue; /* every thread takes part in the loop */
            int64_t j0 = g * PANEL, rows = n - j0 < PANEL ? n - j0 : PANEL;
            gguf_decode_rows_bf16(w + j0 * ldw, rows, k, ldw, qtype, panel, k, row);
            if (m >= OUTER_MIN_M) {
                interleave(panel, k, rows, k, vnni);
                vnni_times_x(x, m, k, ldx, vnni, rows, j0, out, ldo, out_bf16);
                continue;
            }
            int64_t padded = (rows + WR - 1) / WR * WR;
            if (padded > rows)
                memset(panel + rows * k, 0, (size_t)((padded - rows) * k) * sizeof(uint16_t));
            panel_times_x(x, m, k, ldx, panel, k, rows, 0, j0, out, ldo, out_bf16);
        }
        free(panel);
        free(vnni);
        free(row);
    }
    return failed ? NO_MEMORY : 0;
#endif
}

#ifdef HAVE_BF16_GEMM
/* Plain bf16 weights: whole WR-row groups are read where they lie; only a last group of
 * fewer rows is copied into a zero-padded buffer. Threads split the rows in PANEL-row
 * panels, so each x row is read once a panel from cache. */
static int64_t dense_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                          const uint16_t *w, int64_t n, int64_t ldw, void *out, int64_t ldo,
                          int32_t out_bf16, int32_t threads) {
    int64_t full = n / WR * WR, groups = (full + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t j0 = g * PANEL, rows = full - j0 < PANEL ? full - j0 : PANEL;
        panel_times_x(x, m, k, ldx, w + j0 * ldw, ldw, rows, PF, j0, out, ldo, out_bf16);
    }
    if (full == n) return 0;
    uint16_t *tail = aligned_alloc(64, (size_t)(WR * k) * sizeof(uint16_t));
    if (!tail) return NO_MEMORY;
    memset(tail, 0, (size_t)(WR * k) * sizeof(uint16_t));
    for (int64_t j = full; j < n; j++)
        memcpy(tail + (j - full) * k, w + j * ldw, (size_t)k * sizeof(uint16_t));
    panel_times_x(x, m, k, ldx, tail, k, n - full, 0, full, out, ldo, out_bf16);
    free(tail);
    return 0;
}
#endif

/* x [M, K] bf16 @ W.T for a plain bf16 weight W [N, K] (rows `ldw` elements apart, K a
 * multiple of 32) -> out [M, N] as gguf_gemm_bf16_cpu. Any M: at one row it is a GEMV
 * at memory speed. Returns 0, BAD_SHAPE (2) for K, NO_MEMORY, or NO_KERNEL. */
int64_t dense_gemm_bf16_cpu(const void *x, int64_t m, int64_t k, int64_t ldx,
                            const void *w, int64_t n, int64_t ldw, void *out, int64_t ldo,
                            int32_t out_bf16, int32_t threads) {
#ifndef HAVE_BF16_GEMM
    (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)n; (void)ldw; (void)out;
    (void)ldo; (void)out_bf16; (void)threads;
    return NO_KERNEL;
#else
    if (k <= 0 || k % 32 || ldw < k) return 2;
    return dense_gemm(x, m, k, ldx, w, n, ldw, out, ldo, out_bf16, threads);
#endif
}
