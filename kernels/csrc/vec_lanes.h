/* The vector width the attention kernels compute in: 16 lanes (vec16.h) where the CPU has
 * AVX-512, else 8 (vec8.h). Without AVX-512 GCC lowers 16-lane vectors to register pairs,
 * which is fine lane by lane, but not for two-input shuffles (scalar inserts: ~380
 * vinsertps in one decode instantiation on AVX2) or 16-lane values kept in arrays
 * (spilled through general registers): the decode kernel ran 2x slower than SDPA over a
 * dense copy and the prefill kernel 3-5x slower than the torch path on AVX2 before they
 * moved to this. kernels/cpu_native.py hashes it with the sources. */
#ifndef DEEPINFER_VEC_LANES_H
#define DEEPINFER_VEC_LANES_H

#include "vec16.h"
#include "vec8.h"

#if defined(__AVX512F__)
#define LANES 16
typedef v16f vf;
typedef v16i vi;
typedef v16u vu;
typedef v16h vh; /* LANES bf16 values */
#define VLOAD load16    /* (p, i, bf16): LANES elements from index i, as floats */
#define VLOAD_I8 load16_i8 /* (p): LANES int8 codes as floats */
#define VEXP exp16
#define VSEL vsel16
#else
#define LANES 8
typedef v8f vf;
typedef v8i vi;
typedef v8u32 vu;
typedef v8u16 vh;
#define VLOAD load8
#define VLOAD_I8 load_i8
#define VEXP exp8
#define VSEL vsel
#endif

/* The sum of v's lanes, in lane order. */
static inline float hsum_lanes(vf v) {
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += v[j];
    return s;
}

/* Each lane's bf16 bits, rounded to nearest even as f32_to_bf16 (NaN kept quiet). The NaN
 * test compares as signed (both sides below 2^31): an unsigned compare is emulated. */
static inline vu bf16_bits_v(vf v) {
    vu b;
    memcpy(&b, &v, sizeof b);
    const vu nan = (vu)((vi)(b & 0x7FFFFFFFu) > 0x7F800000);
    const vu rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (nan & ((b >> 16) | 0x40u)) | (~nan & rounded);
}

/* LANES floats stored at p from index i: fp32, or rounded to bf16 (VLOAD's inverse). */
static inline void store_v(void *p, int64_t i, vf v, int bf16) {
    if (bf16) {
        const vh h = __builtin_convertvector(bf16_bits_v(v), vh);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        memcpy((float *)p + i, &v, sizeof v);
    }
}

/* v rounded to bf16 and widened back when bf16 is set (what torch does after each op on
 * bf16 tensors); v itself otherwise. */
static inline vf round_v(vf v, int bf16) {
    if (!bf16) return v;
    const vu b = bf16_bits_v(v) << 16;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* Lanes 0 .. LANES - 1 plus `from`, as an int vector (masks of live lanes). */
static inline vi lane_ids(int32_t from) {
    vi r;
    for (int i = 0; i < LANES; ++i) r[i] = from + i;
    return r;
}

#endif
