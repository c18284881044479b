/* The decoder layer's elementwise ops for the CPU, one call each: RMSNorm (with the
 * residual add before it), RoPE of q and k (with Qwen3's per-head q/k norm before it) and
 * SiLU-and-mul. Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: in torch each of these is 5-15 small ops (casts, pow, mean, rsqrt, chunk, cat),
 * and at a decode step of one token a 30-layer model runs ~1300 of them, several ms of
 * per-op overhead when the weights themselves take ~4 ms to read. Here each is one call.
 *
 * The float operations and their roundings follow deepinfer_kernels.reference (Hugging
 * Face's ops): with bf16 tensors (`bf16` set) every intermediate that torch keeps in
 * bf16 is rounded to bf16 here too; statistics are fp32. Sums run in another order than
 * torch's, so results agree to fp32 rounding of the statistics, not bit for bit.
 * Rows are `ld*` elements apart; the last dim is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_lanes.h"

#define PARALLEL_MIN (1 << 15) /* elements below which one thread is faster */

/* Rounded to the dtype: what torch does after each op on bf16 tensors. */
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline size_t esz(int bf16) { return bf16 ? 2 : 4; }

static inline const void *row_c(const void *p, int64_t r, int64_t ld_, int bf16) {
    return (const char *)p + (size_t)(r * ld_) * esz(bf16);
}

static inline void *row_m(void *p, int64_t r, int64_t ld_, int bf16) {
    return (char *)p + (size_t)(r * ld_) * esz(bf16);
}

/* RMSNorm of one row of h values: out = w * round(x * rsqrt(mean(x^2) + eps)). */
static void norm_row(const void *x, const void *w, void *out, int64_t h, float eps,
                     int bf16) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + LANES <= h; i += LANES) {
        vf v = VLOAD(x, i, bf16);
        acc += v * v;
    }
    float ss = hsum_lanes(acc);
    for (; i < h; i++) {
        float v = load1(x, i, bf16);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)h + eps);
    for (i = 0; i + LANES <= h; i += LANES)
        store_v(out, i, VLOAD(w, i, bf16) * round_v(VLOAD(x, i, bf16) * r, bf16), bf16);
    for (; i < h; i++)
        store1(out, i, load1(w, i, bf16) * rnd(load1(x, i, bf16) * r, bf16), bf16);
}

/* out = rms_norm(x [+ res_in]); with res_in, the sum is also written to res_out (it may
 * be res_in itself). */
int64_t rms_norm_cpu(const void *x, int64_t ldx, const void *res_in, int64_t ld_rin,
                     void *res_out, int64_t ld_rout, const void *w, void *out, int64_t ldo,
                     int64_t t, int64_t h, float eps, int32_t bf16, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (t * h >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        const void *src = row_c(x, r, ldx, bf16);
        if (res_in) {
            const void *a = src, *b = row_c(res_in, r, ld_rin, bf16);
            void *s = row_m(res_out, r, ld_rout, bf16);
            int64_t i = 0;
            for (; i + LANES <= h; i += LANES)
                store_v(s, i, VLOAD(a, i, bf16) + VLOAD(b, i, bf16), bf16);
            for (; i < h; i++) store1(s, i, load1(a, i, bf16) + load1(b, i, bf16), bf16);
            src = s;
        }
        norm_row(src, w, row_m(out, r, ldo, bf16), h, eps, bf16);
    }
    return 0;
}

/* One head of d values rotated in place in `buf` (float, already rounded to the dtype):
 * [x1 cos - x2 sin, x2 cos + x1 sin], each product and sum rounded as torch does. */
static void rotate(float *buf, const void *cs, int64_t d, int bf16) {
    const int64_t half = d / 2;
    int64_t i = 0;
    for (; i + LANES <= half; i += LANES) {
        const vf c = VLOAD(cs, i, bf16), s = VLOAD(cs, half + i, bf16);
        vf x1, x2;
        memcpy(&x1, buf + i, sizeof x1);
        memcpy(&x2, buf + half + i, sizeof x2);
        const vf a = round_v(round_v(x1 * c, bf16) - round_v(x2 * s, bf16), bf16);
        const vf b = round_v(round_v(x2 * c, bf16) + round_v(x1 * s, bf16), bf16);
        memcpy(buf + i, &a, sizeof a);
        memcpy(buf + half + i, &b, sizeof b);
    }
    for (; i < half; i++) {
        float c = load1(cs, i, bf16), s = load1(cs, half + i, bf16);
        float x1 = buf[i], x2 = buf[half + i];
        float a = rnd(rnd(x1 * c, bf16) - rnd(x2 * s, bf16), bf16);
        float b = rnd(rnd(x2 * c, bf16) + rnd(x1 * s, bf16), bf16);
        buf[i] = a;
        buf[half + i] = b;
    }
}

static void rope_heads(const void *src, int64_t ld_src, void *dst, int64_t ld_dst,
                       int64_t r, int64_t heads, int64_t d, const void *cs, const void *nw,
                       float eps, int bf16) {
    float buf[1024];
    for (int64_t hh = 0; hh < heads; hh++) {
        const void *x = (const char *)row_c(src, r, ld_src, bf16) + (size_t)(hh * d) * esz(bf16);
        void *y = (char *)row_m(dst, r, ld_dst, bf16) + (size_t)(hh * d) * esz(bf16);
        if (nw) {
            float ss = 0.0f;
            for (int64_t i = 0; i < d; i++) {
                float v = load1(x, i, bf16);
                ss += v * v;
            }
            float inv = 1.0f / sqrtf(ss / (float)d + eps);
            for (int64_t i = 0; i < d; i++)
                buf[i] = rnd(load1(nw, i, bf16) * rnd(load1(x, i, bf16) * inv, bf16), bf16);
        } else {
            for (int64_t i = 0; i < d; i++) buf[i] = load1(x, i, bf16);
        }
        rotate(buf, cs, d, bf16);
        for (int64_t i = 0; i < d; i++) store1(y, i, buf[i], bf16);
    }
}

/* q [T, hq, d] and k [T, hkv, d] (rows ldq / ldk apart) rotated into q_out / k_out
 * (rows ld_qo / ld_ko apart) with row positions[t] of cos_sin [P, d]; per-head RMSNorm
 * first when qw/kw are given. Returns -1 - t for a position outside [0, P). */
int64_t rotary_qk_cpu(const void *q, int64_t ldq, const void *k, int64_t ldk, void *q_out,
                      int64_t ld_qo, void *k_out, int64_t ld_ko, int64_t t, int64_t hq,
                      int64_t hkv, int64_t d, const void *cos_sin, int64_t max_pos,
                      const int64_t *positions, const void *qw, const void *kw, float eps,
                      int32_t bf16, int32_t threads) {
    if (d > 1024 || d % 2) return 1;
    for (int64_t r = 0; r < t; r++)
        if (positions[r] < 0 || positions[r] >= max_pos) return -1 - r;
#pragma omp parallel for num_threads(threads) if (t * (hq + hkv) * d >= PARALLEL_MIN) \
    schedule(static)
    for (int64_t r = 0; r < t; r++) {
        const void *cs = row_c(cos_sin, positions[r], d, bf16);
        rope_heads(q, ldq, q_out, ld_qo, r, hq, d, cs, qw, eps, bf16);
        rope_heads(k, ldk, k_out, ld_ko, r, hkv, d, cs, kw, eps, bf16);
    }
    return 0;
}

/* out [T, i] = silu(gate) * up of x [T, 2i] (gate columns, then up): silu(g) computed
 * in fp32 and rounded to the dtype, times up, rounded again (as torch does). e^x by
 * VEXP (vec_lanes.h): scalar expf took 10 us of a 16 us SiLU call at 1536 wide. */
int64_t silu_and_mul_cpu(const void *x, int64_t ldx, void *out, int64_t ldo, int64_t t,
                         int64_t inter, int32_t bf16, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (t * inter >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        const void *xr = row_c(x, r, ldx, bf16);
        void *o = row_m(out, r, ldo, bf16);
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const vf g = VLOAD(xr, i, bf16);
            const vf sv = round_v(g / (1.0f + VEXP(-g)), bf16);
            store_v(o, i, sv * VLOAD(xr, inter + i, bf16), bf16);
        }
        for (; i < inter; i++) {
            float g = load1(xr, i, bf16), u = load1(xr, inter + i, bf16);
            store1(o, i, rnd(g / (1.0f + expf(-g)), bf16) * u, bf16);
        }
    }
    return 0;
}
