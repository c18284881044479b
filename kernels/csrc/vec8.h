/* 8-lane float vectors (GCC/Clang vector extensions: one AVX2 register, two SSE or NEON
 * ones) and the operations on them that the 8-lane attention kernels use: the general
 * decode kernel (paged_decode_cpu.c), and the wide one where the CPU lacks AVX-512
 * (paged_decode_wide_cpu.c), whose 16-lane shuffles GCC lowers to scalar inserts on AVX2.
 * kernels/cpu_native.py hashes it with the sources, so a change rebuilds the library. */
#ifndef DEEPINFER_VEC8_H
#define DEEPINFER_VEC8_H

#include <stdint.h>
#include <string.h>

#include "vec16.h" /* DEFINE_VSEL, DEFINE_EXP; immintrin.h with AVX2 */

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

/* vsel and exp8: vec16.h's vsel16 and exp16 on 8 lanes (the same macros). */
DEFINE_VSEL(vsel, v8f, v8i)
DEFINE_EXP(exp8, v8f, v8i, vsel)

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
