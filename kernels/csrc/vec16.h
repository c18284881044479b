/* 16-lane float vectors (GCC/Clang vector extensions: one AVX-512 register, or two AVX2
 * ones) and the few operations on them, and on single bf16 values, that more than one C
 * kernel uses. Included by several sources; kernels/cpu_native.py hashes it with them,
 * so a change rebuilds the library. */
#ifndef DEEPINFER_VEC16_H
#define DEEPINFER_VEC16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* One bf16 value (fp32's top half) as a float. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* A float rounded to bf16, to nearest even as torch's copy does; NaN stays a quiet NaN. */
static inline uint16_t f32_to_bf16(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* Element i of p as a float (bf16 or fp32), and a float stored there (rounded). */
static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* Lane-wise m ? a : b (m lanes all-ones or zero); C has no ?: on vectors. One body for
 * every width: vsel16 here, vec8.h's vsel from the same macro. */
#define DEFINE_VSEL(NAME, VF, VI)                 \
    static inline VF NAME(VI m, VF a, VF b) {     \
        VI ai, bi;                                \
        memcpy(&ai, &a, sizeof ai);               \
        memcpy(&bi, &b, sizeof bi);               \
        ai = (ai & m) | (bi & ~m);                \
        memcpy(&a, &ai, sizeof a);                \
        return a;                                 \
    }
DEFINE_VSEL(vsel16, v16f, v16i)

/* 16 elements of p from index i, as floats: bf16 (fp32's top half) or fp32. */
static inline v16f load16(const void *p, int64_t i, int bf16) {
    v16f f;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        v16u b = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &b, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

/* e^x lane by lane: x = n ln2 + r, e^r by a degree-6 polynomial (relative error ~2e-7),
 * 2^n built in the exponent bits. x is clamped to 88.7 (e^x finite); lanes below -87.3
 * (e^x under FLT_MIN, and -inf) give exactly 0. n = round(x / ln2): adding 1.5 * 2^23
 * rounds in the current (nearest) mode; ln2 is taken in two parts. One body for every
 * width: exp16 here, vec8.h's exp8 from the same macro (SEL: that width's select). */
#define DEFINE_EXP(NAME, VF, VI, SEL)                                                \
    static inline VF NAME(VF x) {                                                    \
        const VF lo = (VF){0} - 87.3f, hi = (VF){0} + 88.7f;                         \
        VI tiny = x < lo;                                                            \
        x = SEL(tiny, lo, x); /* keeps n in range; those lanes are zeroed below */   \
        x = SEL(x > hi, hi, x);                                                      \
        VF fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;              \
        VF r = x - fn * 0.693359375f + fn * 2.12194440e-4f;                          \
        VF p = 1.9875691500e-4f + (VF){0};                                           \
        p = p * r + 1.3981999507e-3f;                                                \
        p = p * r + 8.3334519073e-3f;                                                \
        p = p * r + 4.1665795894e-2f;                                                \
        p = p * r + 1.6666665459e-1f;                                                \
        p = p * r + 5.0000001201e-1f;                                                \
        p = p * r * r + r + 1.0f;                                                    \
        VI bits = (__builtin_convertvector(fn, VI) + 127) << 23;                     \
        VF scale;                                                                    \
        memcpy(&scale, &bits, sizeof scale);                                         \
        return SEL(tiny, (VF){0}, p * scale);                                        \
    }
DEFINE_EXP(exp16, v16f, v16i, vsel16)

/* KV cache element kinds (the `cache_kind` argument of the attention and store kernels).
 * An int8 cache (kernels/kv_quant.py) holds each (token, KV head) row of D values (D a
 * multiple of KV_GROUP) as D int8 codes followed by one fp32 scale per KV_GROUP values
 * (unaligned): value i is code[i] * scale[i / KV_GROUP], and a head's row is
 * kv_int8_row(D) = D * 9 / 8 bytes wide. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };
#define KV_GROUP 32

static inline int64_t kv_int8_row(int64_t d) { return d + d / KV_GROUP * 4; }

/* Scale g of an int8 cache row of d codes at p. */
static inline float kv_scale(const int8_t *p, int64_t d, int64_t g) {
    float s;
    memcpy(&s, p + d + 4 * g, sizeof s);
    return s;
}

/* 16 int8 codes at p as floats. Intrinsics where the CPU has the sign-extending loads:
 * GCC lowers __builtin_convertvector from int8 lanes to scalar code (16 scalar
 * conversions), which made the int8 decode kernel 2x slower than reading bf16. */
static inline v16f load16_i8(const int8_t *p) {
    v16f f;
#if defined(__AVX512F__)
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__)
    __m128i c = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
    memcpy(&f, &lo, sizeof lo);
    memcpy((char *)&f + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) f[i] = (float)p[i];
#endif
    return f;
}

#endif
