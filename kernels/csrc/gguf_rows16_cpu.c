/* GGUF Q4_0, Q4_1 and Q8_0 weights repacked in groups of 16 rows, times int8-quantized
 * activations (AVX512-VNNI), for any number of x rows. Built with the other C kernels by
 * kernels/cpu_native.py.
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
 * Layout ("rows16"): rows 16g..16g+15 (contiguous, row_bytes apart) become, block by
 * block, one chunk of 16 x block_bytes bytes (so a row group keeps its size and place):
 *   Q4_0  d[16] fp16, then 4 vectors v of 64 bytes: lane i = bytes 4v..4v+3 of row i's qs
 *         (low nibbles: weights 4v..4v+3, high: 16+4v..), 16 x 18 bytes
 *   Q4_1  d[16], m[16] fp16, then the same 4 vectors, 16 x 20 bytes
 *   Q8_0  d[16] fp16, then 8 vectors q of 64 bytes: lane i = weights 4q..4q+3 of row i,
 *         each + 128 (xor 0x80: unsigned, as vpdpbusd wants), 16 x 34 bytes
 * Numbers: x is quantized per block of 32 to int8 codes with one fp32 scale dx (round to
 * nearest, as gguf_int8_cpu.c), products summed exactly in int32 per block, then
 * out += (d * dx) * sum + m' * (dx * sum of codes) in fp32, block by block, where m' is
 * Q4_1's m, -8 d for Q4_0 and -128 d for Q8_0.
 *   x [M, K] float32 or bfloat16 (x_bf16), rows ldx apart; w [N, row_bytes] packed, N a
 *   multiple of 16, rows contiguous; out [M, N] float32 or bfloat16 (out_bf16), ldo apart.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__F16C__)
#include <immintrin.h>
#define HAVE_ROWS16 1
#endif

#define BAD_TYPE 1
#define BAD_SHAPE 2
#define NO_MEMORY 3
#define GROUP 16
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8

/* Bit i set: ggml type id i has this kernel in this build (none without VNNI). */
int64_t gguf_rows16_types(void) {
#ifdef HAVE_ROWS16
    return (1 << Q4_0) | (1 << Q4_1) | (1 << Q8_0);
#else
    return 0;
#endif
}

static int64_t block_bytes(int32_t qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* One chunk (16 rows' block b) between row-major blocks and the packed layout. `rows`:
 * the 16 rows' block b, row_bytes apart; `chunk`: its 16 x bb packed bytes. */
static void pack_chunk(const uint8_t *rows, int64_t row_bytes, int32_t qtype, uint8_t *chunk) {
    const int64_t scales = qtype == Q4_1 ? 2 : 1;
    const int64_t codes = qtype == Q8_0 ? 32 : 16;
    for (int64_t i = 0; i < GROUP; i++) {
        const uint8_t *blk = rows + i * row_bytes;
        for (int64_t s = 0; s < scales; s++) memcpy(chunk + s * 32 + 2 * i, blk + 2 * s, 2);
        const uint8_t *qs = blk + 2 * scales;
        uint8_t *dst = chunk + 32 * scales;
        for (int64_t v = 0; v < codes / 4; v++)
            for (int64_t j = 0; j < 4; j++) {
                uint8_t c = qs[4 * v + j];
                dst[v * 64 + 4 * i + j] = qtype == Q8_0 ? (uint8_t)(c ^ 0x80) : c;
            }
    }
}

/* Row i (0..15) of a chunk back to its row-major block `blk`. */
static void unpack_row(const uint8_t *chunk, int32_t qtype, int64_t i, uint8_t *blk) {
    const int64_t scales = qtype == Q4_1 ? 2 : 1;
    const int64_t codes = qtype == Q8_0 ? 32 : 16;
    for (int64_t s = 0; s < scales; s++) memcpy(blk + 2 * s, chunk + s * 32 + 2 * i, 2);
    uint8_t *qs = blk + 2 * scales;
    const uint8_t *src = chunk + 32 * scales;
    for (int64_t v = 0; v < codes / 4; v++)
        for (int64_t j = 0; j < 4; j++) {
            uint8_t c = src[v * 64 + 4 * i + j];
            qs[4 * v + j] = qtype == Q8_0 ? (uint8_t)(c ^ 0x80) : c;
        }
}

static void unpack_chunk(const uint8_t *chunk, int32_t qtype, uint8_t *rows, int64_t row_bytes) {
    for (int64_t i = 0; i < GROUP; i++) unpack_row(chunk, qtype, i, rows + i * row_bytes);
}

/* Rows ids[0..t) of a packed w [n, k] as row-major blocks into out [t, row_bytes] (an
 * embedding's lookup). Returns 0, BAD_TYPE, BAD_SHAPE, or 5 + the first id's position
 * when an id is outside 0..n-1 (nothing written for it). */
int64_t gguf_rows16_gather(const uint8_t *w, int64_t n, int64_t k, int32_t qtype,
                           const int64_t *ids, int64_t t, uint8_t *out) {
    const int64_t bb = block_bytes(qtype);
    if (!bb) return BAD_TYPE;
    if (n % GROUP || k <= 0 || k % 32) return BAD_SHAPE;
    const int64_t nb = k / 32, row_bytes = nb * bb;
    for (int64_t r = 0; r < t; r++) {
        const int64_t id = ids[r];
        if (id < 0 || id >= n) return 5 + r;
        const uint8_t *grp = w + (id / GROUP) * GROUP * row_bytes;
        for (int64_t b = 0; b < nb; b++)
            unpack_row(grp + b * GROUP * bb, qtype, id % GROUP, out + r * row_bytes + b * bb);
    }
    return 0;
}

/* Row-major blocks w [n, k / 32 blocks] (rows row_bytes apart and contiguous) to the
 * packed layout in place (unpack: back). Returns 0, BAD_TYPE, BAD_SHAPE (n not whole
 * groups, k not whole blocks) or NO_MEMORY. */
int64_t gguf_rows16_pack(uint8_t *w, int64_t n, int64_t k, int32_t qtype, int32_t unpack,
                         int32_t threads) {
    const int64_t bb = block_bytes(qtype);
    if (!bb) return BAD_TYPE;
    if (n % GROUP || k <= 0 || k % 32) return BAD_SHAPE;
    const int64_t nb = k / 32, row_bytes = nb * bb, groups = n / GROUP;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint8_t *tmp = malloc((size_t)(GROUP * row_bytes));
        failed = tmp == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            uint8_t *base = w + g * GROUP * row_bytes;
            memcpy(tmp, base, (size_t)(GROUP * row_bytes));
            for (int64_t b = 0; b < nb; b++) {
                if (unpack)
                    unpack_chunk(tmp + b * GROUP * bb, qtype, base + b * bb, row_bytes);
                else
                    pack_chunk(tmp + b * bb, row_bytes, qtype, base + b * GROUP * bb);
            }
        }
        free(tmp);
    }
    return failed ? NO_MEMORY : 0;
}

#ifdef HAVE_ROWS16
static inline __m512 load16(const void *x, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One x row -> int8 codes q [nb * 32], per block its scale dx [nb] (x ~= dx * q) and
 * dx * (sum of its codes) sx [nb]. The codes are those of gguf_int8_cpu.c's quantizer:
 * 127 / amax times x, rounded to nearest even. */
static void quantize_row(const void *x, int bf16, int64_t nb, int8_t *q, float *dx,
                         float *sx) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0 = load16(x, b * 32, bf16), v1 = load16(x, b * 32 + 16, bf16);
        __m512 a = _mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign));
        float amax = _mm512_reduce_max_ps(a);
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(c1));
        dx[b] = amax / 127.0f;
        sx[b] = dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    }
}

static inline void store16(void *out, int64_t at, __m512 v, int out_bf16) {
    if (out_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)out + at, v);
}

/* R x rows (quantized: codes xq as 32-bit quads, dx, sx per block, rows `ldq` quads /
 * `nb` blocks apart) against one packed row group: 16 outputs a row into out at j0. */
#define GROUP_KERNEL(R)                                                                   \
    static void group_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const int32_t *xq,\
                          int64_t ldq, const float *dx, const float *sx, void *out,       \
                          int64_t ldo, int64_t j0, int out_bf16) {                        \
        const int64_t bb = block_bytes(qtype) * GROUP;                                    \
        const int q8 = qtype == Q8_0, q41 = qtype == Q4_1;                                \
        const __m512i nib = _mm512_set1_epi8(0x0F);                                       \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                \
            const uint8_t *c = grp + b * bb;                                              \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c));           \
            __m512 m = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 32)))\
                           : _mm512_mul_ps(d, _mm512_set1_ps(q8 ? -128.0f : -8.0f));      \
            const uint8_t *qs = c + (q41 ? 64 : 32);                                      \
            __m512i s[R];                                                                 \
            for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();                    \
            if (q8) {                                                                     \
                for (int v = 0; v < 8; v++) {                                             \
                    __m512i w = _mm512_loadu_si512(qs + 64 * v);                          \
                    for (int r = 0; r < R; r++)                                           \
                        s[r] = _mm512_dpbusd_epi32(                                       \
                            s[r], w, _mm512_set1_epi32(xq[r * ldq + b * 8 + v]));         \
                }                                                                         \
            } else {                                                                      \
                for (int v = 0; v < 4; v++) {                                             \
                    __m512i w = _mm512_loadu_si512(qs + 64 * v);                          \
                    __m512i lo = _mm512_and_si512(w, nib);                                \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);          \
                    for (int r = 0; r < R; r++) {                                         \
                        const int32_t *xb = xq + r * ldq + b * 8;                         \
                        s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(xb[v]));   \
                        s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(xb[v + 4]));\
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            for (int r = 0; r < R; r++) {                                                 \
                __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b]));          \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scale, acc[r]);        \
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);      \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) store16(out, r * ldo + j0, acc[r], out_bf16);         \
    }
GROUP_KERNEL(1)
GROUP_KERNEL(2)
GROUP_KERNEL(3)
GROUP_KERNEL(4)
GROUP_KERNEL(5)
GROUP_KERNEL(6)
GROUP_KERNEL(7)
GROUP_KERNEL(8)
#undef GROUP_KERNEL
#define XR 8 /* x rows a kernel call: 8 fp32 outputs + 8 int32 sums + weights in 32 zmm */
#endif

/* x [m, k] @ W.T for W [n, k] packed as above -> out [m, n]. Returns 0, BAD_TYPE,
 * BAD_SHAPE, NO_MEMORY, or BAD_TYPE for every type in a build without VNNI. */
int64_t gguf_rows16_matmul(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                           const uint8_t *w, int64_t n, int32_t qtype, void *out, int64_t ldo,
                           int32_t out_bf16, int32_t threads) {
#ifndef HAVE_ROWS16
    (void)x; (void)m; (void)k; (void)ldx; (void)x_bf16; (void)w; (void)n; (void)qtype;
    (void)out; (void)ldo; (void)out_bf16; (void)threads;
    return BAD_TYPE;
#else
    const int64_t bb = block_bytes(qtype);
    if (!bb) return BAD_TYPE;
    if (n % GROUP || k <= 0 || k % 32) return BAD_SHAPE;
    if (m <= 0) return 0;
    const int64_t nb = k / 32, ldq = k / 4, groups = n / GROUP;
    const size_t es = x_bf16 ? 2 : 4;
    /* Every x row quantized once, up front: codes, then dx and sx per row and block. */
    int8_t *q = aligned_alloc(64, ((size_t)(m * k) + 63) / 64 * 64);
    float *dx = malloc((size_t)(2 * m * nb) * sizeof(float));
    if (!q || !dx) {
        free(q);
        free(dx);
        return NO_MEMORY;
    }
    float *sx = dx + m * nb;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row((const char *)x + (size_t)(r * ldx) * es, x_bf16, nb, q + r * k,
                     dx + r * nb, sx + r * nb);
    const int32_t *xq = (const int32_t *)q;
    const size_t os = out_bf16 ? 2 : 4;
    /* Row groups split over threads; each runs every x row over its group (read from L1
     * or L2 for every 8 x rows after the first). */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *grp = w + g * GROUP * nb * bb;
        for (int64_t r = 0; r < m; r += XR) {
            const int64_t cnt = m - r < XR ? m - r : XR;
            const int32_t *xr = xq + r * ldq;
            const float *dr = dx + r * nb, *sr = sx + r * nb;
            void *o = (char *)out + (size_t)(r * ldo) * os;
            switch (cnt) {
            case 8: group_8(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 7: group_7(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 6: group_6(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 5: group_5(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 4: group_4(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 3: group_3(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            case 2: group_2(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16); break;
            default: group_1(grp, qtype, nb, xr, ldq, dr, sr, o, ldo, g * GROUP, out_bf16);
            }
        }
    }
    free(q);
    free(dx);
    return 0;
#endif
}
