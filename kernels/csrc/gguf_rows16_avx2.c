/* The row-group products (gguf_rows16.h) on CPUs with AVX2 and no AVX512-VNNI: Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, int8 products for any number of x rows
 * (no bf16 path: without AVX512-BF16 there is no faster one). Built with the other C
 * kernels by kernels/cpu_native.py; gguf_rows16_cpu.c holds the driver.
 *
 * Why: the row-major int8 kernel (gguf_int8_cpu.c) spends ~25 instructions a block of 32
 * weights on one output (decoding the block's codes, its two fp16 fields, a lane sum a
 * row), so on AVX2 it is compute-bound below the memory bandwidth at one x row and
 * grows linearly with more. Here a 16-row group is taken as two halves of 8 rows, one
 * 32-bit lane a row: the 8 rows' scales are one load and one conversion, and a 32-byte
 * load of codes holds four codes of each of the 8 rows, multiplied against four x codes
 * broadcast to every lane.
 *
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies u8 codes by s8 x codes and sums pairs
 * into int16 (saturating), vpmaddwd by ones sums those into int32. The int16 sums are
 * kept over several quads before widening, within what cannot saturate: a 4-bit code
 * times |x| <= 127, two a pair, is at most 3810, so eight quads of a 32-weight block sum
 * to at most 30480 (< 32767); 5-bit codes (31) widen every four (31496). Q8_0's codes
 * are packed signed here (Q8_FLIP is 0: 255 * 127 * 2 would saturate); each quad takes
 * |w| times x with w's sign (vpsignb), widened at once.
 *
 * Numbers: the same as the AVX-512 build's (gguf_rows16_cpu.c): x quantized per block of
 * 32, integer sums exact, then out += (d * dx) * sum + m * (dx * sum of codes) in fp32,
 * Q4_0's and Q5_0's fixed offset folded into the integers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_rows16.h"

#ifdef ROWS16_AVX2
static inline __m256 load8(const void *x, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hmax8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline int32_t hsum8i(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    return _mm_cvtsi128_si32(a);
}

/* gguf_rows16.h says what it writes. */
void rows16_quantize_row(const void *x, int bf16, int64_t nx, int8_t *q, float *dx,
                         float *sx, int32_t *hx) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    /* packs leave 32-bit groups in the order a0 b0 c0 d0 a1 b1 c1 d1: put them back */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nx; b++) {
        __m256 v[4], a = _mm256_setzero_ps();
        int nan = 0;
        for (int i = 0; i < 4; i++) {
            v[i] = load8(x, b * 32 + 8 * i, bf16);
            a = _mm256_max_ps(a, _mm256_and_ps(v[i], sign));
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        const float amax = hmax8(a);
        const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b * 32), _mm256_permutevar8x32_epi32(p, order));
        dx[b] = nan ? __builtin_nanf("") : amax / 127.0f; /* NaN x: NaN out */
        hx[2 * b] = hsum8i(_mm256_add_epi32(c[0], c[1]));
        hx[2 * b + 1] = hsum8i(_mm256_add_epi32(c[2], c[3]));
        sx[b] = dx[b] * (float)(hx[2 * b] + hx[2 * b + 1]);
    }
}

/* The fp16 fields of half h's 8 rows (16 bytes at p). */
static inline __m256 halves8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 fp32 outputs at `at`, or rounded to bf16 (nearest even; NaN stays NaN): vec16.h's
 * f32_to_bf16 on 8 lanes at once. Its scalar loop here made the products 1-11% slower
 * (1 to 16 x rows, the default model's layers): this runs once a group and x row. */
static inline void store8(void *out, int64_t at, __m256 v, int out_bf16) {
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at), _mm256_castsi256_si128(r));
}

/* The int16 pair sums into the int32 lanes. */
static inline __m256i widen(__m256i t) { return _mm256_madd_epi16(t, _mm256_set1_epi16(1)); }

static inline __m256i bcast(const xrows *x, int r, int64_t quad) {
    return _mm256_set1_epi32(x->q[r * x->ldq + quad]);
}

/* Before the loops over a block's code vectors: unrolled two at a time, not whole. Whole,
 * GCC hoisted every product ahead of its sums and spilled them to the stack; two at a
 * time (2-core AVX2 EPYC, 16-128 x rows): Q4_0 / Q4_1 1.11-1.26x, Q4_K 1.16x, Q6_K
 * 1.03-1.06x, Q5_K 1.23x at one x row. Q5_0 / Q5_1 stay whole (one x row: 10-20% faster). */
#define ROLLED _Pragma("GCC unroll 2")

/* R x rows against one packed row group of a 32-weight type, as two halves of 8 rows:
 * 16 outputs a row into out at j0 (rows ldo apart). `five` (a constant in each
 * instance): Q5_0 and Q5_1, the fifth bits spread over each lane's bytes by vpshufb from
 * the row's qh word (as gguf_rows16_cpu.c), set where a mask test hits. V_LOOP: ROLLED
 * or nothing. */
#define GROUP_KERNEL(R, name, five, V_LOOP)                                               \
    static void name##_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x, \
                           void *out, int64_t ldo, int64_t j0, int out_bf16) {            \
        layout l;                                                                         \
        layout_of(qtype, &l);                                                             \
        const int64_t bb = l.bytes * GROUP;                                               \
        const int q8 = qtype == Q8_0, has_m = qtype == Q4_1 || qtype == Q5_1;             \
        const int32_t off = (five) ? -16 : -8;                                            \
        const __m256i nib = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);       \
        const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C,    \
                                                0, 0x04040404, 0x08080808, 0x0C0C0C0C);   \
        const __m256i sel[2] = {_mm256_set1_epi32(0x08040201),                            \
                                _mm256_set1_epi32((int)0x80402010)};                      \
        for (int h = 0; h < 2; h++) {                                                     \
            __m256 acc[R];                                                                \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                     \
            for (int64_t b = 0; b < nb; b++) {                                            \
                const uint8_t *c = grp + b * bb;                                          \
                const __m256 d = halves8(c + 16 * h);                                     \
                const __m256 m = has_m ? halves8(c + 32 + 16 * h) : d;                    \
                const uint8_t *qs = c + 32 * l.halves + ((five) ? 64 : 0) + 32 * h;       \
                __m256i rep[4], s[R];                                                     \
                if (five)                                                                 \
                    for (int e = 0; e < 4; e++)                                           \
                        rep[e] = _mm256_shuffle_epi8(                                     \
                            _mm256_loadu_si256((const __m256i *)(qs - 64)),               \
                            _mm256_add_epi8(lanes, _mm256_set1_epi8((char)e)));           \
                for (int r = 0; r < R; r++) {                                             \
                    const int32_t *hs = x->hx + 2 * (r * x->nx + b);                      \
                    s[r] = has_m || q8 ? _mm256_setzero_si256()                           \
                                       : _mm256_set1_epi32(off * (hs[0] + hs[1]));        \
                }                                                                         \
                if (q8) {                                                                 \
                    for (int v = 0; v < 8; v++) {                                         \
                        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 64 * v));\
                        const __m256i aw = _mm256_sign_epi8(w, w);                        \
                        for (int r = 0; r < R; r++)                                       \
                            s[r] = _mm256_add_epi32(s[r], widen(_mm256_maddubs_epi16(     \
                                aw, _mm256_sign_epi8(bcast(x, r, b * 8 + v), w))));       \
                    }                                                                     \
                } else {                                                                  \
                    __m256i t[R];                                                         \
                    for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();            \
                    V_LOOP                                                                \
                    for (int v = 0; v < 4; v++) {                                         \
                        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 64 * v));\
                        __m256i lo = _mm256_and_si256(w, nib);                            \
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);      \
                        if (five) {                                                       \
                            const __m256i bit = sel[v & 1];                               \
                            const __m256i lo5 = _mm256_cmpeq_epi8(                        \
                                _mm256_and_si256(rep[v >> 1], bit), bit);                 \
                            const __m256i hi5 = _mm256_cmpeq_epi8(                        \
                                _mm256_and_si256(rep[2 + (v >> 1)], bit), bit);           \
                            lo = _mm256_or_si256(lo, _mm256_and_si256(lo5, fifth));       \
                            hi = _mm256_or_si256(hi, _mm256_and_si256(hi5, fifth));       \
                        }                                                                 \
                        for (int r = 0; r < R; r++) {                                     \
                            t[r] = _mm256_add_epi16(                                      \
                                t[r], _mm256_maddubs_epi16(lo, bcast(x, r, b * 8 + v)));  \
                            t[r] = _mm256_add_epi16(                                      \
                                t[r], _mm256_maddubs_epi16(hi, bcast(x, r, b * 8 + v + 4)));\
                        }                                                                 \
                        if ((five && v == 1) || v == 3)                                   \
                            for (int r = 0; r < R; r++) {                                 \
                                s[r] = _mm256_add_epi32(s[r], widen(t[r]));               \
                                t[r] = _mm256_setzero_si256();                            \
                            }                                                             \
                    }                                                                     \
                }                                                                         \
                for (int r = 0; r < R; r++) {                                             \
                    const float dxr = x->dx[r * x->nx + b];                               \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]),                    \
                                             _mm256_mul_ps(d, _mm256_set1_ps(dxr)), acc[r]);\
                    if (has_m)                                                            \
                        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sx[r * x->nx + b]), \
                                                 acc[r]);                                 \
                }                                                                         \
            }                                                                             \
            for (int r = 0; r < R; r++) store8(out, r * ldo + j0 + 8 * h, acc[r], out_bf16);\
        }                                                                                 \
    }

/* Q4_K and Q5_K, as gguf_rows16_cpu.c's KQ_KERNEL (the word vectors' layout is described
 * there) on each half of 8 rows. */
#define KQ_KERNEL(R, name, fifth)                                                         \
    static void name##_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x, \
                           void *out, int64_t ldo, int64_t j0, int out_bf16) {            \
        layout l;                                                                         \
        layout_of(qtype, &l);                                                             \
        const int64_t bb = l.bytes * GROUP;                                               \
        const __m256i nib = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi32(63);          \
        const __m256i low4 = _mm256_set1_epi32(15), top2 = _mm256_set1_epi32(3 << 4);     \
        for (int h = 0; h < 2; h++) {                                                     \
            __m256 acc[R];                                                                \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                     \
            for (int64_t b = 0; b < nb; b++) {                                            \
                const uint8_t *c = grp + b * bb;                                          \
                const uint8_t *wv = c + 32 * l.halves + 32 * h; /* vector i: +64 i */     \
                const __m256 d = halves8(c + 16 * h);                                     \
                const __m256 neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(),                \
                                                      halves8(c + 32 + 16 * h));          \
                const __m256i s0 = _mm256_loadu_si256((const __m256i *)wv);               \
                const __m256i s1 = _mm256_loadu_si256((const __m256i *)(wv + 64));        \
                const __m256i s2 = _mm256_loadu_si256((const __m256i *)(wv + 128));       \
                for (int j = 0; j < 8; j++) {                                             \
                    const int jb = 8 * (j & 3);                                           \
                    __m256i sc, mn;                                                       \
                    if (j < 4) {                                                          \
                        sc = _mm256_and_si256(_mm256_srli_epi32(s0, jb), six);            \
                        mn = _mm256_and_si256(_mm256_srli_epi32(s1, jb), six);            \
                    } else {                                                              \
                        const __m256i e = _mm256_srli_epi32(s2, jb);                      \
                        sc = _mm256_or_si256(                                             \
                            _mm256_and_si256(e, low4),                                    \
                            _mm256_and_si256(_mm256_srli_epi32(s0, jb + 2), top2));       \
                        mn = _mm256_or_si256(                                             \
                            _mm256_and_si256(_mm256_srli_epi32(e, 4), low4),              \
                            _mm256_and_si256(_mm256_srli_epi32(s1, jb + 2), top2));       \
                    }                                                                     \
                    const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));        \
                    const __m256 offset = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(mn));\
                    const int64_t xb = b * 8 + j; /* the x block of sub-block j */        \
                    __m256i s[R], t[R];                                                   \
                    for (int r = 0; r < R; r++)                                           \
                        s[r] = t[r] = _mm256_setzero_si256();                             \
                    ROLLED                                                                \
                    for (int q = 0; q < 8; q++) {                                         \
                        const int64_t at = 64 * (3 + 8 * (fifth) + 8 * (j >> 1) + q);     \
                        __m256i w = _mm256_loadu_si256((const __m256i *)(wv + at));       \
                        w = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(w, 4) : w, nib); \
                        if (fifth) {                                                      \
                            const __m256i hq =                                            \
                                _mm256_loadu_si256((const __m256i *)(wv + 64 * (3 + q))); \
                            w = _mm256_or_si256(                                          \
                                w, _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(hq, 4 - j)  \
                                                           : _mm256_srli_epi16(hq, j - 4), \
                                                    _mm256_set1_epi8(0x10)));             \
                        }                                                                 \
                        for (int r = 0; r < R; r++)                                       \
                            t[r] = _mm256_add_epi16(                                      \
                                t[r], _mm256_maddubs_epi16(w, bcast(x, r, xb * 8 + q)));  \
                        if (((fifth) && q == 3) || q == 7)                                \
                            for (int r = 0; r < R; r++) {                                 \
                                s[r] = _mm256_add_epi32(s[r], widen(t[r]));               \
                                t[r] = _mm256_setzero_si256();                            \
                            }                                                             \
                    }                                                                     \
                    for (int r = 0; r < R; r++) {                                         \
                        const float dxr = x->dx[r * x->nx + xb];                          \
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]),                \
                                                 _mm256_mul_ps(scale, _mm256_set1_ps(dxr)),\
                                                 acc[r]);                                 \
                        acc[r] = _mm256_fmadd_ps(                                         \
                            offset, _mm256_set1_ps(x->sx[r * x->nx + xb]), acc[r]);       \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            for (int r = 0; r < R; r++) store8(out, r * ldo + j0 + 8 * h, acc[r], out_bf16);\
        }                                                                                 \
    }

/* Q6_K, as gguf_rows16_q6k.c's int8 kernel (the layout is described there) on each half
 * of 8 rows: per chunk of 32 and half of 16 (one int8 scale), s = sum of code * x code
 * - 32 * (sum of x codes), then out += (d * scale * dx) * s. Codes are 6-bit: two
 * vpmaddubsw pair sums (2 * 63 * 127 each) add in int16 before widening. */
#define Q6K_KERNEL(R)                                                                     \
    static void q6k_##R(const uint8_t *grp, int32_t qtype, int64_t nb, const xrows *x,    \
                        void *out, int64_t ldo, int64_t j0, int out_bf16) {               \
        (void)qtype;                                                                      \
        const int64_t bb = 210 * GROUP;                                                   \
        const __m256i nib = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);          \
        for (int hr = 0; hr < 2; hr++) {                                                  \
            __m256 acc[R];                                                                \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                     \
            for (int64_t b = 0; b < nb; b++) {                                            \
                const uint8_t *c = grp + b * bb;                                          \
                const uint8_t *wv = c + 32 + 32 * hr; /* word vector i: +64 i */          \
                const __m256 d = halves8(c + 16 * hr);                                    \
                for (int h = 0; h < 2; h++)                                               \
                    for (int t = 0; t < 4; t++) {                                         \
                        const int64_t xb = b * 8 + 4 * h + t; /* the chunk's x block */   \
                        for (int half = 0; half < 2; half++) {                            \
                            const int j = 8 * h + 2 * t + half; /* its scale */           \
                            const __m256i sw = _mm256_loadu_si256(                        \
                                (const __m256i *)(wv + 64 * (48 + j / 4)));               \
                            const __m256i sc = _mm256_srai_epi32(                         \
                                _mm256_slli_epi32(sw, 24 - 8 * (j % 4)), 24);             \
                            const __m256 ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));   \
                            __m256i s[R], t16[R];                                         \
                            for (int r = 0; r < R; r++) {                                 \
                                s[r] = _mm256_set1_epi32(                                 \
                                    -32 * x->hx[2 * (r * x->nx + xb) + half]);            \
                                t16[r] = _mm256_setzero_si256();                          \
                            }                                                             \
                            ROLLED                                                        \
                            for (int q = 4 * half; q < 4 * half + 4; q++) {               \
                                const __m256i ql = _mm256_loadu_si256((const __m256i *)(  \
                                    wv + 64 * (16 * h + 8 * (t & 1) + q)));               \
                                const __m256i qh = _mm256_loadu_si256(                    \
                                    (const __m256i *)(wv + 64 * (32 + 8 * h + q)));       \
                                const __m256i w = _mm256_or_si256(                        \
                                    _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), \
                                                     nib),                                \
                                    _mm256_slli_epi16(                                    \
                                        _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t),    \
                                                         three), 4));                     \
                                for (int r = 0; r < R; r++)                               \
                                    t16[r] = _mm256_add_epi16(                            \
                                        t16[r],                                           \
                                        _mm256_maddubs_epi16(w, bcast(x, r, xb * 8 + q)));\
                                if (q & 1)                                                \
                                    for (int r = 0; r < R; r++) {                         \
                                        s[r] = _mm256_add_epi32(s[r], widen(t16[r]));     \
                                        t16[r] = _mm256_setzero_si256();                  \
                                    }                                                     \
                            }                                                             \
                            for (int r = 0; r < R; r++)                                   \
                                acc[r] = _mm256_fmadd_ps(                                 \
                                    _mm256_cvtepi32_ps(s[r]),                             \
                                    _mm256_mul_ps(ds,                                     \
                                                  _mm256_set1_ps(x->dx[r * x->nx + xb])), \
                                    acc[r]);                                              \
                        }                                                                 \
                    }                                                                     \
            }                                                                             \
            for (int r = 0; r < R; r++) store8(out, r * ldo + j0 + 8 * hr, acc[r], out_bf16);\
        }                                                                                 \
    }

#define ALL_KERNELS(R)                                                                    \
    GROUP_KERNEL(R, group, 0, ROLLED)                                                     \
    GROUP_KERNEL(R, q5, 1, ) KQ_KERNEL(R, q4k, 0) KQ_KERNEL(R, q5k, 1) Q6K_KERNEL(R)
ALL_KERNELS(1)
ALL_KERNELS(2)
ALL_KERNELS(3)
ALL_KERNELS(4)
#undef ALL_KERNELS
#undef Q6K_KERNEL
#undef KQ_KERNEL
#undef GROUP_KERNEL
#undef ROLLED
static group_fn *const GROUP_FNS[XR + 1] = {NULL, group_1, group_2, group_3, group_4};
static group_fn *const Q4K_FNS[XR + 1] = {NULL, q4k_1, q4k_2, q4k_3, q4k_4};
static group_fn *const Q5K_FNS[XR + 1] = {NULL, q5k_1, q5k_2, q5k_3, q5k_4};
static group_fn *const Q5_FNS[XR + 1] = {NULL, q5_1, q5_2, q5_3, q5_4};
static group_fn *const Q6K_FNS_AVX2[XR + 1] = {NULL, q6k_1, q6k_2, q6k_3, q6k_4};

group_fn *const *rows16_kernels(int32_t qtype) {
    return qtype == Q4_K                   ? Q4K_FNS
           : qtype == Q5_K                 ? Q5K_FNS
           : qtype == Q6_K                 ? Q6K_FNS_AVX2
           : qtype == Q5_0 || qtype == Q5_1 ? Q5_FNS
                                            : GROUP_FNS;
}
#endif /* ROWS16_AVX2 */
