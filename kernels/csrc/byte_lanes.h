/* 16 byte codes as int32 lanes, and 16-lane lookups in float tables, for the GGUF block
 * decoders (gguf_cpu.c). On AVX2 without AVX-512 both are written with intrinsics: GCC
 * lowers the 16-lane byte conversion and two-source shuffles to scalar code there (the
 * exact GGUF kernel decoded 4-bit blocks 2.4x slower for it). kernels/cpu_native.py
 * hashes it with the sources. */
#ifndef DEEPINFER_BYTE_LANES_H
#define DEEPINFER_BYTE_LANES_H

#include <stdint.h>
#include <string.h>

#include "vec16.h"

typedef uint8_t v16u8 __attribute__((vector_size(16)));

/* 16 bytes widened to int32 lanes. AVX2 without AVX-512: two vpmovzxbd, named, as GCC
 * lowers the 16-lane conversion to a byte-by-byte loop there. */
static inline v16i u8i(v16u8 v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m128i b;
    memcpy(&b, &v, sizeof b);
    const __m256i lo = _mm256_cvtepu8_epi32(b);
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, sizeof lo);
    memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
    return r;
#else
    return __builtin_convertvector(v, v16i);
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* Lanes of the 8-float quarters q[] picked by idx (0 .. 8 * nq - 1), for 8 outputs:
 * vpermps on each quarter, then blends by the index's upper bits (AVX2 has no
 * two-source or 16-lane permute; GCC's lowering of __builtin_shuffle was scalar). */
static inline __m256 pick8(const __m256 *q, int nq, __m256i idx) {
    __m256 r = _mm256_permutevar8x32_ps(q[0], idx);
    for (int j = 1; j < nq; j++) {
        const __m256 pj = _mm256_permutevar8x32_ps(q[j], idx);
        const __m256i hit = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(8 * j - 1));
        r = _mm256_blendv_ps(r, pj, _mm256_castsi256_ps(hit));
    }
    return r;
}
#endif

/* table[idx[i]] for 16 lanes: the 16-entry table (nq = 2) or t0 then t1 (nq = 4). */
static inline v16f lookup16(v16f t0, v16f t1, int nq, v16i idx) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m256 q[4];
    memcpy(q, &t0, sizeof t0);
    memcpy(q + 2, &t1, sizeof t1);
    __m256i i0, i1;
    memcpy(&i0, &idx, sizeof i0);
    memcpy(&i1, (char *)&idx + sizeof i0, sizeof i1);
    const __m256 r0 = pick8(q, nq, i0), r1 = pick8(q, nq, i1);
    v16f r;
    memcpy(&r, &r0, sizeof r0);
    memcpy((char *)&r + sizeof r0, &r1, sizeof r1);
    return r;
#else
    return nq == 2 ? __builtin_shuffle(t0, idx) : __builtin_shuffle(t0, t1, idx);
#endif
}

#endif
