/* 8-lane float vectors (GCC/Clang vector extensions: one AVX2 register, two SSE or NEON
 * ones) and the operations on them that the 8-lane attention kernels use: the general
 * decode kernel (paged_decode_cpu.c), and the wide one where the CPU lacks AVX-512
 * (paged_decode_wide_cpu.c), whose 16-lane shuffles GCC lowers to scalar inserts on AVX2.
 * kernels/cpu_native.py hashes it with the sources, so a change rebuilds the library. */
#ifndef DEEPINFER_VEC8_H
#define DEEPINFER_VEC8_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load_f32(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof x);  /* unaligned load */
    return x;
}

static inline v8f load_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;  /* bf16 is fp32's top half */
    v8f x;
    memcpy(&x, &w, sizeof x);
    return x;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* Lane-wise m ? a : b (m lanes all-ones or zero); C has no ?: on vectors. */
static inline v8f vsel(v8i m, v8f a, v8f b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* e^x for 8 lanes, as exp16 (vec16.h): x = n ln2 + r, e^r by a degree-6 polynomial
 * (relative error ~2e-7), 2^n built in the exponent bits. x is clamped to 88.7 (e^x
 * finite); lanes below -87.3 (e^x under FLT_MIN, and -inf) give exactly 0. */
static inline v8f exp8(v8f x) {
    const v8f lo = (v8f){0} - 87.3f, hi = (v8f){0} + 88.7f;
    v8i tiny = x < lo;
    x = vsel(tiny, lo, x); /* keeps n in range; those lanes are zeroed below */
    x = vsel(x > hi, hi, x);
    /* n = round(x / ln2): adding 1.5 * 2^23 rounds in the current (nearest) mode. */
    v8f fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v8f r = x - fn * 0.693359375f + fn * 2.12194440e-4f; /* ln2 in two parts */
    v8f p = 1.9875691500e-4f + (v8f){0};
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v8i bits = (__builtin_convertvector(fn, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return vsel(tiny, (v8f){0}, p * scale);
}

#ifdef __clang__
#define SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* The horizontal sums of eight vectors as one vector (r[t] = sum of x[t]'s lanes): a
 * transpose-and-add tree, 12 shuffles + 7 adds instead of 8 separate reductions. */
static inline v8f hsum8(const v8f *x) {
    v8f b[4], c[2];
    for (int k = 0; k < 4; ++k)
        b[k] = SHUF8(x[2 * k], x[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + SHUF8(x[2 * k], x[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; ++k)
        c[k] = SHUF8(b[2 * k], b[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUF8(b[2 * k], b[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF8(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + SHUF8(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float hsum(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* 8 elements of p from index i, as floats: bf16 (fp32's top half) or fp32. */
static inline v8f load8(const void *p, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

/* 8 int8 codes at p as floats (sign-extending load where the CPU has AVX2: GCC lowers
 * __builtin_convertvector from int8 lanes to scalar code). */
static inline v8f load_i8(const int8_t *p) {
    v8f f;
#if defined(__AVX2__)
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&f, &x, sizeof f);
#else
    for (int i = 0; i < 8; i++) f[i] = (float)p[i];
#endif
    return f;
}

#endif
