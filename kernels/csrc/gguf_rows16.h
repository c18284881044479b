/* GGUF weights repacked in groups of 16 rows (the "rows16" layout): what the packing
 * (gguf_rows16_pack.c) and the products (gguf_rows16_cpu.c, gguf_rows16_q6k.c) share.
 *
 * Rows 16g..16g+15 (contiguous, row_bytes apart) become, block by block, one chunk of
 * 16 x block_bytes bytes (so a row group keeps its size and place). A block is seen as
 * fp16 fields and 32-bit words (`layout`); packed, a chunk holds each fp16 field as a
 * 32-byte vector of the 16 rows' values, then each word as a 64-byte vector of the 16
 * rows' words, one to a 32-bit lane:
 *   Q4_0  d[16], then 4 vectors v: lane i = bytes 4v..4v+3 of row i's qs (low nibbles:
 *         weights 4v..4v+3, high: 16+4v..)
 *   Q4_1  d[16], m[16], then the same 4 vectors
 *   Q5_0  d[16], then qh (bit j: weight j's fifth bit), then Q4_0's 4 vectors
 *   Q5_1  d[16], m[16], then qh and the 4 vectors
 *   Q8_0  d[16], then 8 vectors q: lane i = weights 4q..4q+3 of row i, each + 128 (xor
 *         0x80: unsigned, as vpdpbusd wants) in AVX512 builds; as stored (signed) in
 *         AVX2 ones, whose vpmaddubsw would saturate on 255 * 127 * 2
 *   Q4_K  per super-block of 256: d[16], dmin[16], then 35 vectors: 3 of packed 6-bit
 *         scales and mins, 32 of codes
 *   Q5_K  per super-block of 256: d[16], dmin[16], then 43 vectors: Q4_K's 3 of scales
 *         and mins, 8 of qh (fifth bits), 32 of codes
 *   Q6_K  per super-block of 256: d[16] (stored last in the block), then 52 vectors: 32
 *         of ql, 16 of qh, 4 of int8 scales
 */
#ifndef DEEPINFER_GGUF_ROWS16_H
#define DEEPINFER_GGUF_ROWS16_H

#include <stdint.h>

/* Two builds of the products: AVX512-VNNI (gguf_rows16_cpu.c, gguf_rows16_q6k.c: a group
 * is one 16-lane vector), or AVX2 (gguf_rows16_avx2.c: each group as two halves of 8
 * rows, Q6_K left to the row-major kernels). The packing is the same C for both. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__F16C__)
#include <immintrin.h>
#define HAVE_ROWS16 1
#define ROWS16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_ROWS16 1
#define ROWS16_AVX2 1
#endif

#define BAD_TYPE 1
#define BAD_SHAPE 2
#define NO_MEMORY 3
#define GROUP 16
#define Q4_0 2
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define Q4_K 12
#define Q5_K 13
#define Q6_K 14

#ifdef ROWS16_AVX512
#define Q8_FLIP 0x80
#else
#define Q8_FLIP 0
#endif

/* A block as fp16 fields and 32-bit words: `halves` fp16 at byte `half_at`, `words`
 * words at byte `word_at` (every other byte; Q8_0's flipped by `flip`). */
typedef struct {
    int64_t bytes, weights, half_at, halves, word_at, words;
    uint8_t flip;
} layout;

static inline int layout_of(int32_t qtype, layout *l) {
    static const layout q4_0 = {18, 32, 0, 1, 2, 4, 0}, q4_1 = {20, 32, 0, 2, 4, 4, 0},
                        q5_0 = {22, 32, 0, 1, 2, 5, 0}, q5_1 = {24, 32, 0, 2, 4, 5, 0},
                        q8_0 = {34, 32, 0, 1, 2, 8, Q8_FLIP}, q4_k = {144, 256, 0, 2, 4, 35, 0},
                        q5_k = {176, 256, 0, 2, 4, 43, 0}, q6_k = {210, 256, 208, 1, 0, 52, 0};
    switch (qtype) {
    case Q4_0: *l = q4_0; return 1;
    case Q4_1: *l = q4_1; return 1;
    case Q5_0: *l = q5_0; return 1;
    case Q5_1: *l = q5_1; return 1;
    case Q8_0: *l = q8_0; return 1;
    case Q4_K: *l = q4_k; return 1;
    case Q5_K: *l = q5_k; return 1;
    case Q6_K: *l = q6_k; return 1;
    default: *l = (layout){0, 1, 0, 0, 0, 0, 0}; return 0;
    }
}

/* Bit i set: ggml type id i has a row-group kernel in this build (gguf_rows16_pack.c). */
int64_t gguf_rows16_types(void);

/* A [n, k] weight's blocks per row and bytes per block; 0, BAD_TYPE or BAD_SHAPE (n not
 * whole groups, k not whole blocks). */
static inline int64_t geometry(int32_t qtype, int64_t n, int64_t k, int64_t *nb,
                               int64_t *bb) {
    layout l;
    if (!layout_of(qtype, &l)) return BAD_TYPE;
    if (n % GROUP || k <= 0 || k % l.weights) return BAD_SHAPE;
    *nb = k / l.weights;
    *bb = l.bytes;
    return 0;
}

#ifdef HAVE_ROWS16
/* The quantized x rows a kernel call reads: codes as 32-bit quads (rows ldq quads
 * apart), and per row nx blocks of 32: scales dx and dx times the codes' sum sx. hx:
 * the codes' sums per 16 (2 nx a row; Q6_K's scales are per 16 weights). */
typedef struct {
    const int32_t *q;
    const float *dx, *sx;
    const int32_t *hx;
    int64_t ldq, nx;
} xrows;

/* R x rows (R = 1..XR) against one packed row group `grp` of nb blocks: 16 outputs a row
 * into out at column j0 (rows ldo apart), fp32 or bf16 (out_bf16). */
typedef void group_fn(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x,
                      void *out, int64_t ldo, int64_t j0, int out_bf16);

/* Each build's: its kernels for `qtype` by x rows (index 1..XR), and the x quantizer: one
 * x row -> int8 codes q [nx * 32], per block of 32 its scale dx [nx] (x ~= dx * q) and
 * dx * (sum of its codes) sx [nx], and the codes' sums per 16 hx [2 nx]. The codes are
 * those of gguf_int8_cpu.c's quantizer: 127 / amax times x, rounded to nearest even. */
group_fn *const *rows16_kernels(int32_t qtype);
void rows16_quantize_row(const void *x, int bf16, int64_t nx, int8_t *q, float *dx,
                         float *sx, int32_t *hx);

#ifdef ROWS16_AVX2
#define XR 4 /* x rows a kernel call: 4 fp32 outputs + 4 int32 sums + weights in 16 ymm */
#else
#define XR 8 /* x rows a kernel call: 8 fp32 outputs + 8 int32 sums + weights in 32 zmm */
#endif
#endif /* HAVE_ROWS16 */

#ifdef ROWS16_AVX512

/* Q6_K (gguf_rows16_q6k.c): its int8 kernels by x rows, and its many-row path, the
 * whole product with each group decoded to bf16 once (AVX512-BF16 builds). */
extern group_fn *const Q6K_FNS[XR + 1];
int64_t rows16_q6k_bf16_matmul(const void *x, int64_t m, int64_t k, int64_t ldx,
                               int32_t x_bf16, const uint8_t *w, int64_t n, void *out,
                               int64_t ldo, int32_t out_bf16, int32_t threads);

static inline __m512 halves16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* 16 fp32 outputs at `at`, or rounded to bf16 (nearest even; NaN stays NaN). */
static inline void store16(void *out, int64_t at, __m512 v, int out_bf16) {
    if (!out_bf16) {
        _mm512_storeu_ps((float *)out + at, v);
        return;
    }
#ifdef __AVX512BF16__
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(v));
#else /* VNNI without AVX512-BF16 (Cascade Lake, Ice Lake): the rounding in integers */
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(r));
#endif
}
#endif /* ROWS16_AVX512 */

#endif
