/* GGUF block weights on the CPU: a matmul that reads the weights as stored in the file
 * (4-8 bits a weight) and a dequantization for the rows that must be whole (embedding
 * rows, the large-batch path that hands a dense tile to the BLAS).
 *
 * Built with paged_decode_cpu.c into one library by kernels/cpu_native.py (no torch
 * headers). Layouts as in kernels/gguf_blocks.py; the type ids are ggml's.
 *   x    [M, K]       float32, rows `ldx` floats apart
 *   w    [N, row]     uint8 blocks, rows `ldw` bytes apart, row = K / bw * bytes
 *   out  [M, N]       float32, rows `ldo` floats apart
 *
 * Why decode a whole weight row into a float buffer first, then dot it with every x row:
 * a row's blocks are decoded once whatever M is (the decode costs more than the FMAs at
 * small M), the buffer stays in L1/L2, and the dot loop is the same for every type.
 * The products are summed in fp32 in vec_lanes.h's vectors (16 lanes with AVX-512, 8
 * without), then across lanes: not the order of a BLAS, so results agree with
 * dequantize + matmul to fp32 rounding, not bit for bit.
 * Output rows are split across OpenMP threads (torch's own libgomp pool).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "byte_lanes.h"
#include "vec_lanes.h"
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define BAD_TYPE 1
#define BAD_SHAPE 2
#define NO_MEMORY 3

typedef uint16_t v16u16 __attribute__((vector_size(32)));

/* IEEE half -> float, subnormals included (they occur as block scales). */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h); /* one instruction, exact, subnormals included */
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Unaligned vector loads and stores through may_alias types: one vector move each. (A
 * memcpy into a byte vector was split by GCC 12 into byte loads and inserts when two
 * such loads were adjacent, as in Q8_0, making that type 4x slower.) */
typedef v16u8 v16u8_u __attribute__((aligned(1), may_alias));
typedef v16f v16f_u __attribute__((aligned(4), may_alias));

static inline v16u8 bytes16(const uint8_t *p) { return *(const v16u8_u *)p; }

static inline void put(float *dst, v16f v) { *(v16f_u *)dst = v; }

static inline v16f get(const float *src) { return *(const v16f_u *)src; }

/* Weights 0-15 and 16-31 of a 32-weight block: the low and high nibbles of 16 bytes. */
static inline void nibbles(const uint8_t *qs, v16i *lo, v16i *hi) {
    v16u8 q = bytes16(qs);
    *lo = u8i(q & 0x0F);
    *hi = u8i(q >> 4);
}

/* Bit 4 of weights 0-15 and 16-31 of a Q5 block from its little-endian u32 `qh`. */
static inline void fifth_bits(const uint8_t *p, v16i *lo, v16i *hi) {
    uint32_t qh;
    memcpy(&qh, p, 4);
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* Named: GCC builds a 16-lane broadcast from 16 scalar stores on AVX2. */
    const __m256i all = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1);
    __m256i part[4];
    for (int j = 0; j < 4; j++)
        part[j] = _mm256_slli_epi32(
            _mm256_and_si256(_mm256_srlv_epi32(all, _mm256_add_epi32(
                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                        _mm256_set1_epi32(8 * j))),
                             one),
            4);
    memcpy(lo, part, sizeof *lo);
    memcpy(hi, part + 2, sizeof *hi);
#else
    static const v16u LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16u all = (v16u){0} + qh;
    *lo = (v16i)(((all >> LANE) & 1u) << 4);
    *hi = (v16i)(((all >> (LANE + 16u)) & 1u) << 4);
#endif
}

/* 16 signed bytes at p widened to int32. GCC 12 turns a signed-byte vector conversion
 * (and the unsigned one with the sign restored) into byte-by-byte loads and inserts,
 * which made Q8_0 4x slower than the 4-bit types: with AVX-512 the one instruction that
 * does it is named. */
static inline v16i i8i(const uint8_t *p) {
#ifdef __AVX512F__
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    v16i r;
    memcpy(&r, &v, sizeof r);
    return r;
#else
    return (u8i(bytes16(p)) ^ 0x80) - 0x80;
#endif
}

static inline void decode_q8_0(const uint8_t *b, float *w) {
    float d = half(b);
    put(w, __builtin_convertvector(i8i(b + 2), v16f) * d);
    put(w + 16, __builtin_convertvector(i8i(b + 18), v16f) * d);
}

/* The 4- and 5-bit types look their weights up in a table of the block's 16 or 32
 * possible values (d * q + m, one FMA for the whole table): a lane permute per 16
 * weights instead of an int -> float conversion and an FMA each. */
static const v16f IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* A Q4_0 / Q4_1 block's 16 possible weights (one expression each, shared by every path
 * that decodes them, so they round alike). */
static inline v16f q4_0_table(const uint8_t *b) { return (IOTA - 8.0f) * half(b); }
static inline v16f q4_1_table(const uint8_t *b) { return IOTA * half(b) + half(b + 2); }

static inline void decode_q4_0(const uint8_t *b, float *w) {
    v16f table = q4_0_table(b);
    v16i lo, hi;
    nibbles(b + 2, &lo, &hi);
    put(w, lookup16(table, table, 2, lo));
    put(w + 16, lookup16(table, table, 2, hi));
}

static inline void decode_q4_1(const uint8_t *b, float *w) {
    v16f table = q4_1_table(b);
    v16i lo, hi;
    nibbles(b + 4, &lo, &hi);
    put(w, lookup16(table, table, 2, lo));
    put(w + 16, lookup16(table, table, 2, hi));
}

/* Q5: the 32-entry table is two vectors; a two-source permute picks from both. */
static inline void decode_q5(const uint8_t *qh, const uint8_t *qs, v16f t0, v16f t1,
                             float *w) {
    v16i lo, hi, h0, h1;
    nibbles(qs, &lo, &hi);
    fifth_bits(qh, &h0, &h1);
    put(w, lookup16(t0, t1, 4, lo | h0));
    put(w + 16, lookup16(t0, t1, 4, hi | h1));
}

static inline void decode_q5_0(const uint8_t *b, float *w) {
    float d = half(b);
    decode_q5(b + 2, b + 6, (IOTA - 16.0f) * d, IOTA * d, w);
}

static inline void decode_q5_1(const uint8_t *b, float *w) {
    float d = half(b), m = half(b + 2);
    decode_q5(b + 4, b + 8, IOTA * d + m, (IOTA + 16.0f) * d + m, w);
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

/* Q4_K (qh NULL) and Q5_K: four groups of 32 bytes, each group's low nibbles then its
 * high nibbles being two consecutive sub-blocks of 32; Q5_K's bit 4 of weight i of
 * sub-block j is bit j of qh[i]. */
static inline void decode_k_affine(const uint8_t *b, const uint8_t *qh, const uint8_t *qs,
                            float *w) {
    float d = half(b), dmin = half(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        float step = d * (float)sc, low = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int half16 = 0; half16 < 2; half16++) {
            v16i v = u8i((bytes16(q + 16 * half16) >> shift) & 0x0F);
            if (qh) {
                v16i h = u8i((bytes16(qh + 16 * half16) >> j) & 1);
                v |= h << 4;
            }
            put(w + 32 * j + 16 * half16, step * __builtin_convertvector(v, v16f) - low);
        }
    }
}

static inline void decode_q4_k(const uint8_t *b, float *w) { decode_k_affine(b, NULL, b + 16, w); }

static inline void decode_q5_k(const uint8_t *b, float *w) { decode_k_affine(b, b + 16, b + 48, w); }

/* Q6_K: two halves of 128 weights; chunk c (32 weights) of half h takes the low or high
 * nibbles of ql[64h + 32(c % 2) ...] and bit pair c of qh[32h ...]; sixteen sub-blocks
 * of 16 with int8 scales. */
static inline void decode_q6_k(const uint8_t *b, float *w) {
    float d = half(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++) {
        for (int c = 0; c < 4; c++) {
            for (int half16 = 0; half16 < 2; half16++) {
                const uint8_t *ql = b + 64 * h + 32 * (c % 2) + 16 * half16;
                const uint8_t *qh = b + 128 + 32 * h + 16 * half16;
                v16i lo = u8i((bytes16(ql) >> (4 * (c / 2))) & 0x0F);
                v16i hi = u8i((bytes16(qh) >> (2 * c)) & 3);
                v16i q = (lo | (hi << 4)) - 32;
                int sub = 8 * h + 2 * c + half16;
                float step = d * (float)scales[sub];
                put(w + 128 * h + 32 * c + 16 * half16, step * __builtin_convertvector(q, v16f));
            }
        }
    }
}

typedef struct {
    int32_t type_id, block_weights, block_bytes;
} format;

static const format FORMATS[] = {
    {2, 32, 18}, {3, 32, 20},   {6, 32, 22},    {7, 32, 24},
    {8, 32, 34}, {12, 256, 144}, {13, 256, 176}, {14, 256, 210},
};

static const format *find_format(int32_t qtype) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].type_id == qtype) return &FORMATS[i];
    return NULL;
}

/* Shapes the kernels accept: a known type, K a positive multiple of its block. */
static const format *check(int32_t qtype, int64_t k, int64_t *rc) {
    const format *f = find_format(qtype);
    if (!f) {
        *rc = BAD_TYPE;
        return NULL;
    }
    if (k <= 0 || k % f->block_weights) {
        *rc = BAD_SHAPE;
        return NULL;
    }
    *rc = 0;
    return f;
}

/* Each per-type loop below is written out per type through these macros (a switch
 * outside the loop, direct calls inside): the decoders inline into the loop and keep
 * their vectors in registers. Through a function pointer each block cost a call and a
 * round trip through memory, which made the matmul compute-bound at ~3 GB/s. */
#define EACH_TYPE(CASE)                                                                   \
    CASE(2, decode_q4_0, 32, 18)                                                          \
    CASE(3, decode_q4_1, 32, 20)                                                          \
    CASE(6, decode_q5_0, 32, 22)                                                          \
    CASE(7, decode_q5_1, 32, 24)                                                          \
    CASE(8, decode_q8_0, 32, 34)                                                          \
    CASE(12, decode_q4_k, 256, 144)                                                       \
    CASE(13, decode_q5_k, 256, 176)                                                       \
    CASE(14, decode_q6_k, 256, 210)

/* The nb blocks of one row decoded into w (nb * block_weights floats). */
static void decode_row(int32_t qtype, const uint8_t *row, int64_t nb, float *w) {
#define DECODE_CASE(ID, FN, BW, BB)                                                       \
    case ID:                                                                              \
        for (int64_t b = 0; b < nb; b++) FN(row + b * BB, w + b * BW);                    \
        break;
    switch (qtype) { EACH_TYPE(DECODE_CASE) }
#undef DECODE_CASE
}

/* The dot products accumulate in vec_lanes.h's vectors: 16-lane accumulators carried
 * through a loop went through the stack and general registers on AVX2 (GCC 12 keeps no
 * 64-byte vector in registers there), which made the products ~8x slower. */
typedef vf vf_u __attribute__((aligned(4), may_alias));

static inline vf getv(const float *src) { return *(const vf_u *)src; }

/* One weight row against one x row, block by block: each block decoded into a buffer
 * that stays in L1 (in registers, once inlined) and multiplied at once. Two blocks a
 * step into four accumulators: with one FMA chain per half block, the loop waited on
 * the FMA latency (4 cycles) instead of issuing. */
static float dot_row(int32_t qtype, const uint8_t *row, int64_t nb, const float *x) {
    vf a[4][16 / LANES] = {{{0}}}; /* four 16-float accumulators */
    float buf[512] __attribute__((aligned(64)));
#define DOT_CASE(ID, FN, BW, BB)                                                          \
    case ID: {                                                                            \
        int64_t b = 0;                                                                    \
        for (; b + 2 <= nb; b += 2) {                                                     \
            FN(row + b * BB, buf);                                                        \
            FN(row + (b + 1) * BB, buf + BW);                                             \
            const float *xb = x + b * BW;                                                 \
            for (int c = 0; c < 2 * BW; c += 64)                                          \
                for (int i = 0; i < 4; i++)                                               \
                    for (int h = 0; h < 16 / LANES; h++) {                                \
                        const int at = c + 16 * i + LANES * h;                            \
                        a[i][h] += getv(buf + at) * getv(xb + at);                        \
                    }                                                                     \
        }                                                                                 \
        if (b < nb) {                                                                     \
            FN(row + b * BB, buf);                                                        \
            const float *xb = x + b * BW;                                                 \
            for (int c = 0; c < BW; c += 32)                                              \
                for (int i = 0; i < 2; i++)                                               \
                    for (int h = 0; h < 16 / LANES; h++) {                                \
                        const int at = c + 16 * i + LANES * h;                            \
                        a[i][h] += getv(buf + at) * getv(xb + at);                        \
                    }                                                                     \
        }                                                                                 \
        break;                                                                            \
    }
    switch (qtype) { EACH_TYPE(DOT_CASE) }
#undef DOT_CASE
    vf t = (a[0][0] + a[1][0]) + (a[2][0] + a[3][0]);
    for (int h = 1; h < 16 / LANES; h++) t += (a[0][h] + a[1][h]) + (a[2][h] + a[3][h]);
    return hsum_lanes(t);
}

/* 16 floats -> bfloat16, rounded to nearest even as f32_to_bf16 (vec16.h) (a row of a dequantized tile:
 * the scalar loop was most of the tile path's cost). */
static inline v16u16 bf16x16(v16f v) {
#ifdef __AVX512BF16__
    __m512 f;
    memcpy(&f, &v, sizeof f);
    __m256bh h = _mm512_cvtneps_pbh(f); /* one instruction, same rounding */
    v16u16 r;
    memcpy(&r, &h, sizeof r);
    return r;
#else
    v16u b;
    memcpy(&b, &v, sizeof b);
    v16u rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    v16u nan = (b >> 16) | 0x40u;
    v16u is_nan = (v16u)((b & 0x7FFFFFFFu) > 0x7F800000u);
    return __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), v16u16);
#endif
}


/* A decoded row w (k floats, k a multiple of 32) against four x rows `ldx` apart: four
 * accumulators share each load of w. */
static inline void dot4(const float *w, int64_t k, const float *x, int64_t ldx, float r[4]) {
    vf a[4][16 / LANES] = {{{0}}};
    for (int64_t i = 0; i < k; i += 16)
        for (int h = 0; h < 16 / LANES; h++) {
            const vf wv = getv(w + i + LANES * h);
            for (int j = 0; j < 4; j++) a[j][h] += wv * getv(x + j * ldx + i + LANES * h);
        }
    for (int j = 0; j < 4; j++) {
        vf t = a[j][0];
        for (int h = 1; h < 16 / LANES; h++) t += a[j][h];
        r[j] = hsum_lanes(t);
    }
}

static inline float dot1(const float *w, int64_t k, const float *x) {
    vf a[32 / LANES] = {{0}};
    for (int64_t i = 0; i < k; i += 32)
        for (int h = 0; h < 32 / LANES; h++)
            a[h] += getv(w + i + LANES * h) * getv(x + i + LANES * h);
    vf t = a[0];
    for (int h = 1; h < 32 / LANES; h++) t += a[h];
    return hsum_lanes(t);
}

/* x is float32, or bfloat16 when x_bf16 (widened once into a float32 copy: M x K is
 * small next to the weights); out likewise with out_bf16. One x row: each weight row is
 * decoded block by block into the dot product. More: each weight row is decoded once
 * into a buffer, then dotted with the x rows four at a time. */
int64_t gguf_matmul_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                        const uint8_t *w, int64_t n, int64_t ldw, int32_t qtype, void *out,
                        int64_t ldo, int32_t out_bf16, int32_t threads) {
    int64_t rc;
    const format *f = check(qtype, k, &rc);
    if (!f) return rc;
    int64_t nb = k / f->block_weights;
    const float *xf = (const float *)x;
    float *wide = NULL;
    if (x_bf16) {
        wide = malloc((size_t)(m * k) * sizeof(float));
        if (!wide) return NO_MEMORY;
        for (int64_t r = 0; r < m; r++) {
            for (int64_t i = 0; i < k; i++) wide[r * k + i] = load1(x, r * ldx + i, 1);
        }
        xf = wide;
        ldx = k;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* 64-byte aligned so the 16-float loads stay within one cache line. A thread
         * without its buffer still takes part in the loop (every thread must), idle. */
        float *row = m > 1 ? aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64)) : NULL;
        failed = m > 1 && row == NULL;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *wj = w + j * ldw;
            if (m == 1) {
                store1(out, j, dot_row(qtype, wj, nb, xf), out_bf16);
                continue;
            }
            if (!row) continue;
            decode_row(qtype, wj, nb, row);
            int64_t r = 0;
            for (; r + 4 <= m; r += 4) {
                float v[4];
                dot4(row, k, xf + r * ldx, ldx, v);
                for (int i = 0; i < 4; i++) store1(out, (r + i) * ldo + j, v[i], out_bf16);
            }
            for (; r < m; r++)
                store1(out, r * ldo + j, dot1(row, k, xf + r * ldx), out_bf16);
        }
        free(row);
    }
    free(wide);
    return failed ? NO_MEMORY : 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Q4_0 / Q4_1 rows straight to bf16: the block's table rounded to bf16 once (the same
 * bits as rounding each decoded weight), then one 32-lane word permute picks its 32
 * weights by their nibbles and one store writes them: no fp32 row in between. */
static void q4_rows_bf16(const uint8_t *w, int64_t n, int64_t nb, int64_t ldw, int q4_1,
                         uint16_t *out, int64_t ldo) {
    const int64_t bb = q4_1 ? 20 : 18, codes = q4_1 ? 4 : 2;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * ldw;
        uint16_t *dst = out + j * ldo;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            v16f t = q4_1 ? q4_1_table(blk) : q4_0_table(blk);
            __m512 tf;
            memcpy(&tf, &t, sizeof tf);
            __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(tf));
            __m128i q = _mm_loadu_si128((const __m128i *)(blk + codes));
            __m256i idx8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low),
                                            _mm_and_si128(q, low));
            __m512i wv = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx8), table);
            _mm512_storeu_si512(dst + b * 32, wv);
        }
    }
}
#endif

/* Rows of w decoded into bfloat16 rows of out (`ldo` elements apart), on the calling
 * thread; `row` is a 64-byte aligned buffer of k floats. The fused bf16 GEMM
 * (gguf_gemm_bf16_cpu.c) decodes its weight panels with it. */
int64_t gguf_decode_rows_bf16(const uint8_t *w, int64_t n, int64_t k, int64_t ldw,
                              int32_t qtype, uint16_t *out, int64_t ldo, float *row) {
    int64_t rc;
    const format *f = check(qtype, k, &rc);
    if (!f) return rc;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (qtype == 2 || qtype == 3) {
        q4_rows_bf16(w, n, k / 32, ldw, qtype == 3, out, ldo);
        return 0;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        decode_row(qtype, w + j * ldw, k / f->block_weights, row);
        uint16_t *dst = out + j * ldo;
        for (int64_t i = 0; i < k; i += 16) {
            v16u16 h = bf16x16(get(row + i));
            memcpy(dst + i, &h, sizeof h);
        }
    }
    return 0;
}

/* Rows of w decoded into out [N, K] (rows `ldo` elements apart): float32, or bfloat16
 * when out_bf16. */
int64_t gguf_dequantize_cpu(const uint8_t *w, int64_t n, int64_t k, int64_t ldw,
                            int32_t qtype, void *out, int64_t ldo, int32_t out_bf16,
                            int32_t threads) {
    int64_t rc;
    const format *f = check(qtype, k, &rc);
    if (!f) return rc;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *row = out_bf16 ? aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64)) : NULL;
        failed = out_bf16 && row == NULL;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            if (!out_bf16)
                decode_row(qtype, w + j * ldw, k / f->block_weights, (float *)out + j * ldo);
            else if (row)
                gguf_decode_rows_bf16(w + j * ldw, 1, k, ldw, qtype, (uint16_t *)out + j * ldo,
                                      ldo, row);
        }
        free(row);
    }
    return failed ? NO_MEMORY : 0;
}
