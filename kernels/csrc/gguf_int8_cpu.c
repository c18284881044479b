/* GGUF matmul with int8 activations, for 16-bit activations on CPUs with VNNI: each x
 * row is quantized per block of 32 to int8 with one fp32 scale (round to nearest), and
 * the weights' 4- or 8-bit codes are multiplied with it by integer dot products
 * (vpdpbusd: 32 products summed into 8 lanes per instruction), as llama.cpp does.
 *
 * Why: the exact path (gguf_cpu.c) decodes every weight to fp32 and is compute-bound on
 * 2 cores at about half the memory bandwidth; integer dot products take ~4x fewer
 * instructions per weight. The cost is the activation's rounding: at most half a step of
 * 1/127 of its block's largest |x| per element, so a dot product moves by at most
 * sum|w| * max|x| / 254 over a block, well inside bf16's own 2^-9 per output for
 * typical data (the tests hold it to 2e-2 of |x| @ |w|, as any 16-bit path). fp32
 * activations never come here.
 *
 * Types: Q4_0, Q4_1, Q8_0 (the others take the exact path). Layouts as in gguf_blocks.py.
 *   x [M, K] float32 or bfloat16 (x_bf16), rows ldx apart; w [N, row] blocks, rows ldw
 *   bytes apart; out [M, N] float32 or bfloat16, rows ldo apart.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_INT8 1
#endif

#define BAD_TYPE 1
#define BAD_SHAPE 2
#define NO_MEMORY 3

/* Bit i set: ggml type id i has the int8 path in this build (none without VNNI). */
int64_t gguf_int8_types(void) {
#ifdef HAVE_INT8
    return (1 << 2) | (1 << 3) | (1 << 8);
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

static inline float load_x(const void *x, int64_t i, int bf16) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t b = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t to_bf16(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* One x row -> int8 codes q [nb * 32], scales d [nb] (x ~= d * q) and the scaled code
 * sums s [nb] = d * sum(q) (the offset terms of Q4_0 and Q4_1 need them). */
static void quantize_row(const void *x, int bf16, int64_t nb, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < nb; b++) {
        float v[32], amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            v[i] = load_x(x, b * 32 + i, bf16);
            float a = v[i] < 0 ? -v[i] : v[i];
            amax = a > amax ? a : amax;
        }
        float step = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int c = (int)__builtin_lrintf(v[i] * inv);
            q[b * 32 + i] = (int8_t)c;
            sum += c;
        }
        d[b] = step;
        s[b] = step * (float)sum;
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

/* One block's 32 weight codes as u8, the x codes' sign folded in where the weights are
 * signed (Q8_0: |w| times x with w's sign), and the block's scale and offset term. */
typedef struct {
    __m256i codes;
    float d, m; /* w = d * code + m (Q4_0: m = -8 d; Q8_0: m = 0, codes signed) */
} wblock;

static inline wblock load_block(int32_t qtype, const uint8_t *row, int64_t b) {
    wblock wb;
    if (qtype == 8) {
        const uint8_t *blk = row + b * 34;
        wb.codes = _mm256_loadu_si256((const __m256i *)(blk + 2));
        wb.d = half(blk);
        wb.m = 0.0f;
    } else if (qtype == 2) {
        const uint8_t *blk = row + b * 18;
        wb.codes = q4_codes(blk + 2);
        wb.d = half(blk);
        wb.m = -8.0f * wb.d;
    } else {
        const uint8_t *blk = row + b * 20;
        wb.codes = q4_codes(blk + 4);
        wb.d = half(blk);
        wb.m = half(blk + 2);
    }
    return wb;
}

/* The integer dot product of a block's codes with 32 x codes (8 int32 lanes). */
static inline __m256i block_dot(int32_t qtype, __m256i codes, __m256i xv) {
    const __m256i zero = _mm256_setzero_si256();
    if (qtype == 8)
        return _mm256_dpbusd_epi32(zero, _mm256_sign_epi8(codes, codes),
                                   _mm256_sign_epi8(xv, codes));
    return _mm256_dpbusd_epi32(zero, codes, xv);
}

/* One weight row against R (1..4) quantized x rows, k apart: each block's codes are
 * loaded once for all R rows. sum_j (d c_j + m) x_j = d dx sum c_j q_j + m dx sum q_j. */
#define ROWS_KERNEL(R)                                                                    \
    static void dot_rows_##R(int32_t qtype, const uint8_t *row, int64_t nb,              \
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
                acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(wb.d * xd[r * (k / 32) + b]),  \
                                         acc[r]);                                         \
                offset[r] += wb.m * xs[r * (k / 32) + b];                                 \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) res[r] = hsum8(acc[r]) + offset[r];                   \
    }
ROWS_KERNEL(1)
ROWS_KERNEL(2)
ROWS_KERNEL(3)
ROWS_KERNEL(4)
#undef ROWS_KERNEL

static inline void put(void *out, int64_t at, float v, int out_bf16) {
    if (out_bf16)
        ((uint16_t *)out)[at] = to_bf16(v);
    else
        ((float *)out)[at] = v;
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
    if (k <= 0 || k % 32) return BAD_SHAPE;
    int64_t nb = k / 32;
    int8_t *xq = malloc((size_t)(m * k));
    float *xd = malloc((size_t)(m * nb) * sizeof(float) * 2);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return NO_MEMORY;
    }
    float *xs = xd + m * nb;
    for (int64_t r = 0; r < m; r++) {
        const char *xr = (const char *)x + (size_t)(r * ldx) * (x_bf16 ? 2 : 4);
        quantize_row(xr, x_bf16, nb, xq + r * k, xd + r * nb, xs + r * nb);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wj = w + j * ldw;
        for (int64_t r = 0; r < m;) {
            float res[4];
            int64_t left = m - r;
            int64_t cnt = left >= 4 ? 4 : left;
            const int8_t *q = xq + r * k;
            const float *d = xd + r * nb, *sm = xs + r * nb;
            if (cnt == 4)
                dot_rows_4(qtype, wj, nb, q, k, d, sm, res);
            else if (cnt == 3)
                dot_rows_3(qtype, wj, nb, q, k, d, sm, res);
            else if (cnt == 2)
                dot_rows_2(qtype, wj, nb, q, k, d, sm, res);
            else
                dot_rows_1(qtype, wj, nb, q, k, d, sm, res);
            for (int64_t i = 0; i < cnt; i++) put(out, (r + i) * ldo + j, res[i], out_bf16);
            r += cnt;
        }
    }
    free(xq);
    free(xd);
    return 0;
#endif
}
