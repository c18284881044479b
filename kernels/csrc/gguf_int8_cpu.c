/* GGUF matmul with int8 activations, for 16-bit activations on CPUs with AVX2: each x
 * row is quantized per block of 32 to int8 with one fp32 scale (round to nearest), and
 * the weights' 4- or 8-bit codes are multiplied with it by integer dot products
 * (vpdpbusd with VNNI: 32 products summed into 8 lanes per instruction; else two AVX2
 * instructions), as llama.cpp does.
 *
 * Why: the exact path (gguf_cpu.c) decodes every weight to fp32 and is compute-bound on
 * 2 cores at about half the memory bandwidth; integer dot products take ~4x fewer
 * instructions per weight. The cost is the activation's rounding: at most half a step of
 * 1/127 of its block's largest |x| per element, so a dot product moves by at most
 * sum|w| * max|x| / 254 over a block, well inside bf16's own 2^-9 per output for
 * typical data (the tests hold it to 2e-2 of |x| @ |w|, as any 16-bit path). fp32
 * activations never come here.
 *
 * Types: all eight. Each is taken 32 weights at a time (a K-quant's 256-weight block as
 * eight sub-blocks): 32 unsigned codes c (Q8_0: signed) and, per half of 16, a scale and
 * an offset, w = d_half * c + m_half. Q4_0: d, -8d. Q4_1: d, m. Q5_0/Q5_1 likewise with
 * the fifth bit. Q4_K/Q5_K: d * sc_j, -dmin * mn_j of sub-block j. Q6_K: its 16-weight
 * sub-blocks' d * sc, -32 d * sc. Layouts as in gguf_blocks.py.
 *   x [M, K] float32 or bfloat16 (x_bf16), rows ldx apart; w [N, row] blocks, rows ldw
 *   bytes apart; out [M, N] float32 or bfloat16, rows ldo apart.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* VNNI (AVX512-VNNI with VL) sums 4 u8 x s8 products a lane in one instruction; plain AVX2
 * takes two (vpmaddubsw into int16 pairs, vpmaddwd by ones into int32), as llama.cpp's
 * AVX2 path does. The pairs cannot saturate: codes are at most 63 (Q6_K) or, Q8_0's
 * with their sign moved to x, 128, and x codes at most 127: 2 * 128 * 127 < 32767. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_INT8 1
#endif

#define BAD_TYPE 1
#define BAD_SHAPE 2
#define NO_MEMORY 3

/* Bit i set: ggml type id i has the int8 path in this build (none without AVX2). */
int64_t gguf_int8_types(void) {
#ifdef HAVE_INT8
    return (1 << 2) | (1 << 3) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 12) | (1 << 13) |
           (1 << 14);
#else
    return 0;
#endif
}

#ifdef HAVE_INT8
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One x row -> int8 codes q [nb * 32], scales d [nb] (x ~= d * q) and the scaled code
 * sums of each half block, s [2 nb] = d * sum(q over 16) (the offset terms need them). */
static void quantize_row(const void *x, int bf16, int64_t nb, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < nb; b++) {
        float v[32], amax = 0.0f;
        int nan = 0;
        for (int i = 0; i < 32; i++) {
            v[i] = load1(x, b * 32 + i, bf16);
            float a = v[i] < 0 ? -v[i] : v[i];
            amax = a > amax ? a : amax;
            nan |= v[i] != v[i];
        }
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        /* A NaN has no code: the block's scale becomes NaN, so every output of the row is
         * NaN, as a float product would give, not a product with the NaN read as 0. */
        float step = nan ? __builtin_nanf("") : amax / 127.0f;
        int sum[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            int c = (int)__builtin_lrintf(v[i] * inv);
            q[b * 32 + i] = (int8_t)c;
            sum[i / 16] += c;
        }
        d[b] = step;
        s[2 * b] = step * (float)sum[0];
        s[2 * b + 1] = step * (float)sum[1];
    }
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* The 32 codes of a Q4 block (nibbles: weights 0-15 low, 16-31 high) as u8. */
static inline __m256i q4_codes(const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

/* 32 weights' codes as u8 (Q8_0: signed, its sign folded in by block_dot), and per half
 * of 16 the scale (lanes 0-3: weights 0-15; lanes 4-7: 16-31, as vpdpbusd sums them) and
 * the offset coefficient: w = d_half * code + m_half. */
typedef struct {
    __m256i codes;
    __m256 d;
    float m_lo, m_hi;
} wblock;

static inline __m256 halves(float lo, float hi) {
    return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
}

static inline wblock affine(__m256i codes, float d, float m) {
    wblock wb = {codes, _mm256_set1_ps(d), m, m};
    return wb;
}

/* 32 nibbles, low (shift 0) or high (4) ones, of 32 bytes. */
static inline __m256i nibbles32(const uint8_t *p, int shift) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srli_epi16(raw, shift), _mm256_set1_epi8(0x0F));
}

/* Bit `bit` of each of 32 bytes, moved to bit 4 (a code's fifth bit). */
static inline __m256i bit4_of(__m256i bytes, int bit) {
    __m256i v = _mm256_slli_epi16(_mm256_srli_epi16(bytes, bit), 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* The fifth bits of a Q5_0/Q5_1 block: bit i of its little-endian u32 qh, moved to bit 4
 * of byte i. */
static inline __m256i q5_high(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    /* Byte i picks byte i / 8 of qh (per 128-bit lane, each holding qh four times),
     * then keeps bit i % 8. */
    __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                   2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), sel);
    __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(rep, mask), mask);
    return _mm256_and_si256(hit, _mm256_set1_epi8(0x10));
}

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j from the 12 bytes at `s`. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Weights 32 b .. 32 b + 31 of a row. */
static inline wblock load_block(int32_t qtype, const uint8_t *row, int64_t b) {
    switch (qtype) {
    case 8: {
        const uint8_t *blk = row + b * 34;
        return affine(_mm256_loadu_si256((const __m256i *)(blk + 2)), half(blk), 0.0f);
    }
    case 2: {
        const uint8_t *blk = row + b * 18;
        float d = half(blk);
        return affine(q4_codes(blk + 2), d, -8.0f * d);
    }
    case 3: {
        const uint8_t *blk = row + b * 20;
        return affine(q4_codes(blk + 4), half(blk), half(blk + 2));
    }
    case 6: {
        const uint8_t *blk = row + b * 22;
        float d = half(blk);
        return affine(_mm256_or_si256(q4_codes(blk + 6), q5_high(blk + 2)), d, -16.0f * d);
    }
    case 7: {
        const uint8_t *blk = row + b * 24;
        return affine(_mm256_or_si256(q4_codes(blk + 8), q5_high(blk + 4)), half(blk),
                      half(blk + 2));
    }
    case 12:
    case 13: {
        int j = (int)(b % 8), sc, mn;
        const uint8_t *blk = row + (b / 8) * (qtype == 12 ? 144 : 176);
        k_scale_min(blk + 4, j, &sc, &mn);
        const uint8_t *qs = blk + (qtype == 12 ? 16 : 48) + 32 * (j / 2);
        __m256i codes = nibbles32(qs, 4 * (j % 2));
        if (qtype == 13)
            codes = _mm256_or_si256(
                codes, bit4_of(_mm256_loadu_si256((const __m256i *)(blk + 16)), j));
        return affine(codes, half(blk) * (float)sc, -half(blk + 2) * (float)mn);
    }
    default: { /* 14, Q6_K: chunk c of half h, sub-blocks of 16 with int8 scales */
        int j = (int)(b % 8), h = j / 4, c = j % 4;
        const uint8_t *blk = row + (b / 8) * 210;
        __m256i lo = nibbles32(blk + 64 * h + 32 * (c % 2), 4 * (c / 2));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), _mm256_set1_epi8(3));
        __m256i codes = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * h + 2 * c;
        float d = half(blk + 208), d_lo = d * (float)sc[0], d_hi = d * (float)sc[1];
        wblock wb = {codes, halves(d_lo, d_hi), -32.0f * d_lo, -32.0f * d_hi};
        return wb;
    }
    }
}

/* u8 x s8 products summed by four into 8 int32 lanes (lane i: bytes 4i..4i+3). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The integer dot product of a block's codes with 32 x codes (8 int32 lanes). */
static inline __m256i block_dot(int32_t qtype, __m256i codes, __m256i xv) {
    if (qtype == 8)
        return dot_u8s8(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(xv, codes));
    return dot_u8s8(codes, xv);
}

/* One weight row against R (1..4) quantized x rows, k apart: each block's codes are
 * loaded once for all R rows. Per half block, sum_j (d c_j + m) x_j = d dx sum c_j q_j +
 * m dx sum q_j. */
#define ROWS_KERNEL(R)                                                                    \
    static inline __attribute__((always_inline)) void dot_rows_##R(int32_t qtype, const uint8_t *row, int64_t nb,              \
                             const int8_t *xq, int64_t k, const float *xd,               \
                             const float *xs, float *res) {                               \
        __m256 acc[R];                                                                    \
        float offset[R];                                                                  \
        for (int r = 0; r < R; r++) {                                                     \
            acc[r] = _mm256_setzero_ps();                                                 \
            offset[r] = 0.0f;                                                             \
        }                                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                \
            wblock wb = load_block(qtype, row, b);                                        \
            for (int r = 0; r < R; r++) {                                                 \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * 32));  \
                __m256 f = _mm256_cvtepi32_ps(block_dot(qtype, wb.codes, xv));            \
                __m256 dx = _mm256_set1_ps(xd[r * (k / 32) + b]);                         \
                acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(wb.d, dx), acc[r]);             \
                const float *s2 = xs + 2 * (r * (k / 32) + b);                            \
                offset[r] += wb.m_lo * s2[0] + wb.m_hi * s2[1];                           \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) res[r] = hsum8(acc[r]) + offset[r];                   \
    }
ROWS_KERNEL(1)
ROWS_KERNEL(2)
ROWS_KERNEL(3)
ROWS_KERNEL(4)
#undef ROWS_KERNEL

/* cnt (1..4) x rows against one weight row, for one type: a function per type, so that
 * load_block's switch folds away inside the block loop (through the switch each block
 * cost a dispatch: K-quants ran 1.5x slower). */
typedef void rows_fn(const uint8_t *row, int64_t nb, const int8_t *xq, int64_t k,
                     const float *xd, const float *xs, float *res, int64_t cnt);
#define TYPED_ROWS(T)                                                                     \
    static void rows_t##T(const uint8_t *row, int64_t nb, const int8_t *xq, int64_t k,    \
                          const float *xd, const float *xs, float *res, int64_t cnt) {    \
        if (cnt == 4)                                                                     \
            dot_rows_4(T, row, nb, xq, k, xd, xs, res);                                   \
        else if (cnt == 3)                                                                \
            dot_rows_3(T, row, nb, xq, k, xd, xs, res);                                   \
        else if (cnt == 2)                                                                \
            dot_rows_2(T, row, nb, xq, k, xd, xs, res);                                   \
        else                                                                              \
            dot_rows_1(T, row, nb, xq, k, xd, xs, res);                                   \
    }
TYPED_ROWS(2)
TYPED_ROWS(3)
TYPED_ROWS(6)
TYPED_ROWS(7)
TYPED_ROWS(8)
TYPED_ROWS(12)
TYPED_ROWS(13)
TYPED_ROWS(14)
#undef TYPED_ROWS

static rows_fn *rows_for(int32_t qtype) {
    switch (qtype) {
    case 2: return rows_t2;
    case 3: return rows_t3;
    case 6: return rows_t6;
    case 7: return rows_t7;
    case 8: return rows_t8;
    case 12: return rows_t12;
    case 13: return rows_t13;
    default: return rows_t14;
    }
}

#endif

int64_t gguf_matmul_int8_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                             const uint8_t *w, int64_t n, int64_t ldw, int32_t qtype,
                             void *out, int64_t ldo, int32_t out_bf16, int32_t threads) {
#ifndef HAVE_INT8
    (void)x; (void)m; (void)k; (void)ldx; (void)x_bf16; (void)w; (void)n; (void)ldw;
    (void)qtype; (void)out; (void)ldo; (void)out_bf16; (void)threads;
    return BAD_TYPE;
#else
    if (!((gguf_int8_types() >> qtype) & 1)) return BAD_TYPE;
    if (k <= 0 || k % (qtype >= 12 ? 256 : 32)) return BAD_SHAPE;
    int64_t nb = k / 32;
    int8_t *xq = malloc((size_t)(m * k));
    float *xd = malloc((size_t)(m * nb) * sizeof(float) * 3); /* scales, then half sums */
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return NO_MEMORY;
    }
    float *xs = xd + m * nb;
    for (int64_t r = 0; r < m; r++) {
        const char *xr = (const char *)x + (size_t)(r * ldx) * (x_bf16 ? 2 : 4);
        quantize_row(xr, x_bf16, nb, xq + r * k, xd + r * nb, xs + 2 * r * nb);
    }
    rows_fn *rows = rows_for(qtype);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wj = w + j * ldw;
        for (int64_t r = 0; r < m;) {
            float res[4];
            int64_t left = m - r;
            int64_t cnt = left >= 4 ? 4 : left;
            rows(wj, nb, xq + r * k, k, xd + r * nb, xs + 2 * r * nb, res, cnt);
            for (int64_t i = 0; i < cnt; i++)
                store1(out, (r + i) * ldo + j, res[i], out_bf16);
            r += cnt;
        }
    }
    free(xq);
    free(xd);
    return 0;
#endif
}
