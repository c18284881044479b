/* Token sampling for the CPU: one draw per row from softmax(logits / T), after top-k,
 * top-p and min-p where a row has them, by inverting the row's cumulative distribution
 * (in token-id order) at a given uniform. The semantics are
 * deepinfer_kernels.reference.sample_tokens_filtered's; built with the other C kernels by
 * kernels/cpu_native.py.
 *
 * Why: in torch, top-p is a sort of the whole vocabulary per row (256 x 49k: ~0.7 s a
 * step on 2 cores, more than the default model's own decode step), and even plain
 * temperature sampling is six passes with [N, V] temporaries. Here a row is read once
 * into a thread's buffer (scaled, with its maximum), then:
 *  - no filter: exp into the buffer with per-16 sums, then a scan for the first token
 *    whose running sum passes u * total (the same per-16 sums, so it always ends inside);
 *  - filters: only the tokens within some distance of the maximum are collected (the
 *    distance grows until they provably hold every token top-k/top-p can keep: at least
 *    k of them, or at least top_p of the mass). In the filters' order (value, then id:
 *    a stable descending sort) top-k is a quickselect of the k-th, top-p a quickselect
 *    on mass (no full sort: a flat row's nucleus can be most of the vocabulary), min-p
 *    a threshold; the kept tokens are drawn in id order, sorted when few, scattered into
 *    a zeroed row when many. Sums run in double over the vector exp's probabilities.
 * NaN logits are never drawn; a row with no finite logit gets id 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_lanes.h"

#define PARALLEL_MIN (1 << 16) /* elements below which one thread is faster */

typedef struct {
    float v;    /* scaled logit */
    float p;    /* exp(v - max): unnormalised probability */
    int64_t id;
} cand_t;

static int by_id(const void *a, const void *b) {
    const cand_t *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

/* The sum of the 16 floats at e in one fixed order: two passes that sum the same values
 * agree (blocks of 16 whatever the vector width, so draws do not depend on the CPU). */
static inline float sum16(const float *e) {
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += e[l];
    return s;
}

static inline int any_lane(vi m) {
    int32_t r = 0;
    for (int l = 0; l < LANES; l++) r |= m[l];
    return r != 0;
}

/* buf = x / t (fp32 division, as torch's) with NaN as -inf (a NaN logit is never drawn,
 * as in the Triton kernel); returns the maximum. */
static float scale_row(const float *x, int64_t vocab, float t, float *buf) {
    const int64_t full = vocab & ~(int64_t)(LANES - 1);
    const vf ninf = (vf){0} - INFINITY;
    vf vm = ninf;
    for (int64_t j = 0; j < full; j += LANES) {
        vf v;
        memcpy(&v, x + j, sizeof v);
        v = v / t;
        v = VSEL(v != v, ninf, v);
        memcpy(buf + j, &v, sizeof v);
        vm = VSEL(v > vm, v, vm);
    }
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = vm[l] > m ? vm[l] : m;
    for (int64_t j = full; j < vocab; j++) {
        float v = x[j] / t;
        v = v != v ? -INFINITY : v;
        buf[j] = v;
        m = v > m ? v : m;
    }
    return m;
}

/* The draw over e[0..vocab) (unnormalised probabilities, 0 = not drawable): the first
 * token whose running sum passes u * total. Both passes sum the same per-16 blocks into a
 * double, so the scan always ends inside. */
static int64_t draw_from_probs(const float *e, int64_t vocab, float u) {
    const int64_t full = vocab & ~(int64_t)15;
    double total = 0.0;
    for (int64_t j = 0; j < full; j += 16) total += sum16(e + j);
    for (int64_t j = full; j < vocab; j++) total += e[j];
    const double target = (double)u * total;
    double acc = 0.0;
    for (int64_t j = 0; j < full; j += 16) {
        const float s = sum16(e + j);
        if (acc + s > target) {
            int64_t last = -1;
            for (int l = 0; l < 16; l++) {
                if (e[j + l] <= 0.0f) continue;
                last = j + l;
                acc += e[j + l];
                if (acc > target) return last;
            }
            if (last >= 0) return last; /* the lanes' own sum rounded below the block's */
        } else {
            acc += s;
        }
    }
    int64_t last = -1;
    for (int64_t j = full; j < vocab; j++) {
        if (e[j] <= 0.0f) continue;
        last = j;
        acc += e[j];
        if (acc > target) return j;
    }
    if (last >= 0) return last;
    for (int64_t j = vocab - 1; j >= 0; j--) /* u * total rounded past every block */
        if (e[j] > 0.0f) return j;
    return 0;
}

/* No filter: buf holds the scaled row; exps are written over it, then drawn. */
static int64_t draw_all(float *buf, int64_t vocab, float m, float u) {
    const int64_t full = vocab & ~(int64_t)(LANES - 1);
    for (int64_t j = 0; j < full; j += LANES) {
        vf v;
        memcpy(&v, buf + j, sizeof v);
        v = VEXP(v - m);
        memcpy(buf + j, &v, sizeof v);
    }
    for (int64_t j = full; j < vocab; j++) buf[j] = expf(buf[j] - m);
    return draw_from_probs(buf, vocab, u);
}

/* The filters' order: larger value first, then smaller id (a stable descending sort). */
static inline int before(const cand_t *a, const cand_t *b) {
    return a->v > b->v || (a->v == b->v && a->id < b->id);
}

static inline void swap_c(cand_t *a, cand_t *b) {
    cand_t t = *a;
    *a = *b;
    *b = t;
}

/* c[lo..hi) (hi - lo >= 2) around a median-of-three pivot; returns its index i, with
 * c[lo..i) before it and c(i..hi) after it in `before` order (keys are distinct). */
static int64_t partition(cand_t *c, int64_t lo, int64_t hi) {
    const int64_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (before(&c[mid], &c[lo])) swap_c(&c[mid], &c[lo]);
    if (before(&c[last], &c[lo])) swap_c(&c[last], &c[lo]);
    if (before(&c[last], &c[mid])) swap_c(&c[last], &c[mid]);
    swap_c(&c[mid], &c[last]); /* the median as the pivot, at the end */
    const cand_t pivot = c[last];
    int64_t i = lo;
    for (int64_t j = lo; j < last; j++)
        if (before(&c[j], &pivot)) swap_c(&c[i++], &c[j]);
    swap_c(&c[i], &c[last]);
    return i;
}

/* Moves the first k (in `before` order) of c[0..n) to c[0..k), 0 < k < n. */
static void select_first(cand_t *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        const int64_t i = partition(c, lo, hi);
        if (i == k) return;
        if (i < k)
            lo = i + 1;
        else
            hi = i;
    }
}

/* Top-p over c[0..n): moves to the front the tokens whose probability mass before them
 * (in `before` order) is below `bound`, and returns their count (the first always
 * stays). A quickselect on mass: expected O(n), where a sort would be O(n log n). */
static int64_t select_mass(cand_t *c, int64_t n, double bound) {
    int64_t lo = 0, hi = n;
    double fixed = 0.0; /* the mass of c[0..lo), all kept */
    while (hi - lo > 16) {
        const int64_t i = partition(c, lo, hi);
        double mu = 0.0;
        for (int64_t j = lo; j < i; j++) mu += c[j].p;
        if (fixed + mu >= bound) {
            hi = i; /* the pivot and all after it are dropped */
        } else {
            fixed += mu + c[i].p;
            lo = i + 1;
        }
    }
    for (int64_t i = lo + 1; i < hi; i++) /* a few left: insertion sort */
        for (int64_t j = i; j > lo && before(&c[j], &c[j - 1]); j--) swap_c(&c[j], &c[j - 1]);
    while (lo < hi && (lo == 0 || fixed < bound)) fixed += c[lo++].p;
    return lo;
}

/* Tokens with buf >= c into cand (with VEXP(v - m), which is within 1.2e-7 of expf and
 * exact where the probability is a power of two, as torch's float32 softmax: a top-p
 * cut exactly on such a partial sum falls where the reference's does); returns their
 * count, and in *rest the mass of the others (summed per 16 into a double) when
 * want_rest (top-p without top-k: its cut depends on that mass). */
static int64_t collect(const float *buf, int64_t vocab, float c, float m, int want_rest,
                       cand_t *cand, double *rest) {
    const int64_t full = vocab & ~(int64_t)15;
    const vf cv = (vf){0} + c;
    int64_t n = 0;
    double r = 0.0;
    for (int64_t j = 0; j < full; j += 16) {
        float left[16]; /* the block's probabilities of tokens not collected */
        for (int h = 0; h < 16; h += LANES) {
            vf v;
            memcpy(&v, buf + j + h, sizeof v);
            const vi ge = v >= cv;
            const int any = any_lane(ge);
            if (!any && !want_rest) continue; /* top-k alone: no exp for blocks left out */
            const vf e = VEXP(v - m);
            if (any) {
                for (int l = 0; l < LANES; l++)
                    if (ge[l]) cand[n++] = (cand_t){v[l], e[l], j + h + l};
            }
            const vf rest_e = VSEL(ge, (vf){0}, e);
            memcpy(left + h, &rest_e, sizeof rest_e);
        }
        if (want_rest) r += sum16(left);
    }
    for (int64_t j = full; j < vocab; j++) {
        vf v = (vf){0} + buf[j];
        const float e = VEXP(v - m)[0];
        if (buf[j] >= c)
            cand[n++] = (cand_t){buf[j], e, j};
        else
            r += e;
    }
    *rest = r;
    return n;
}

/* How many of buf are >= c (vector compares only: a cheap pass to size a collection). */
static int64_t count_ge(const float *buf, int64_t vocab, float c) {
    const int64_t full = vocab & ~(int64_t)(LANES - 1);
    const vf cv = (vf){0} + c;
    vi acc = (vi){0};
    for (int64_t j = 0; j < full; j += LANES) {
        vf v;
        memcpy(&v, buf + j, sizeof v);
        acc -= (vi)(v >= cv); /* true lanes are -1 */
    }
    int64_t n = 0;
    for (int l = 0; l < LANES; l++) n += acc[l];
    for (int64_t j = full; j < vocab; j++) n += buf[j] >= c;
    return n;
}

/* Filters: k (1..vocab; vocab = off), top_p (> 0; >= 1 off), min_p (<= 0 off). buf
 * (the scaled row) is scratch once its tokens are collected. */
static int64_t draw_filtered(float *buf, int64_t vocab, float m, int64_t k, float top_p,
                             float min_p, float u, cand_t *cand) {
    const int do_k = k < vocab, do_p = top_p < 1.0f, do_min = min_p > 0.0f;
    const float log_min = do_min ? logf(min_p) : -INFINITY;
    /* min-p keeps buf - m >= log_min (in fp32, as the reference). Without top-p nothing
     * below floor_c can be kept, so the collection need not reach further (with top-p
     * it must: the cut depends on the mass of every token top-k keeps). The margin
     * covers the roundings of both sides. */
    const float floor_c = do_min && !do_p
        ? m + log_min - (fabsf(m) + fabsf(log_min)) * 1e-6f - 1e-30f : -INFINITY;
    float dist = 8.0f;
    if (do_k) { /* the smallest doubling that holds k tokens: ~k collected, not thousands */
        dist = 0.25f;
        while (dist < 1e30f && count_ge(buf, vocab, m - dist) < k) dist *= 2.0f;
    }
    int64_t n = 0;
    double rest = 0.0;
    for (;;) {
        float c = m - dist;
        if (!(c > floor_c) || dist > 1e30f || !(do_k || do_p)) c = floor_c;
        n = collect(buf, vocab, c, m, do_p && !do_k, cand, &rest);
        if (c == floor_c) break;
        if (do_k) {
            if (n >= k) break; /* every token top-k keeps (ties included) is in */
        } else if (do_p) {
            double mass = 0.0;
            for (int64_t i = 0; i < n; i++) mass += cand[i].p;
            if (mass >= (double)top_p * (mass + rest)) break; /* the cut falls inside */
        }
        dist *= 4.0f;
    }
    int64_t keep = n;
    if (do_k && k < n) { /* the first k, then every token tied with the k-th */
        select_first(cand, n, k);
        float kth = cand[0].v;
        for (int64_t i = 1; i < k; i++) kth = cand[i].v < kth ? cand[i].v : kth;
        keep = k;
        for (int64_t i = k; i < n; i++)
            if (cand[i].v >= kth) swap_c(&cand[keep++], &cand[i]);
    }
    if (do_p) {
        double z = do_k ? 0.0 : rest;
        for (int64_t i = 0; i < keep; i++) z += cand[i].p;
        const float tp = top_p > 0.0f ? top_p : 1e-30f;
        keep = select_mass(cand, keep, (double)tp * z);
    }
    if (do_min) { /* the maximum itself (v - m = 0) always stays */
        int64_t kept = 0;
        for (int64_t i = 0; i < keep; i++)
            if (cand[i].v - m >= log_min) swap_c(&cand[kept++], &cand[i]);
        keep = kept;
    }
    if (keep > 512) { /* many tokens: scattered into a zeroed row, drawn in one scan */
        memset(buf, 0, (size_t)vocab * sizeof *buf);
        for (int64_t i = 0; i < keep; i++) buf[cand[i].id] = cand[i].p;
        return draw_from_probs(buf, vocab, u);
    }
    qsort(cand, (size_t)keep, sizeof *cand, by_id);
    double total = 0.0;
    for (int64_t i = 0; i < keep; i++) total += cand[i].p;
    const double target = (double)u * total;
    double acc = 0.0;
    int64_t last = cand[0].id;
    for (int64_t i = 0; i < keep; i++) {
        if (cand[i].p <= 0.0f) continue;
        last = cand[i].id;
        acc += cand[i].p;
        if (acc > target) return last;
    }
    return last;
}

/* logits [n, vocab] fp32 (rows ld apart); temps, uniforms [n] fp32; top_k [n] int64,
 * top_p / min_p [n] fp32, each NULL when no row has that filter; out [n] int64.
 * Returns 0, or 1 when a buffer could not be allocated. */
int64_t sample_tokens_cpu(const float *logits, int64_t ld, int64_t n, int64_t vocab,
                          const float *temps, const float *uniforms, const int64_t *top_k,
                          const float *top_p, const float *min_p, int64_t *out,
                          int32_t threads) {
    const int filtered = top_k != NULL || top_p != NULL || min_p != NULL;
    int64_t failed = 0;
#pragma omp parallel num_threads(threads) if (n > 1 && n * vocab >= PARALLEL_MIN) \
    reduction(| : failed)
    {
        float *buf = malloc((size_t)vocab * sizeof *buf);
        cand_t *cand = filtered ? malloc((size_t)vocab * sizeof *cand) : NULL;
        const int ok = buf != NULL && (!filtered || cand != NULL);
        if (!ok) failed = 1;
        /* Every thread takes part in the loop (a worksharing construct), even one whose
         * buffers failed: it skips its rows and the call reports the failure. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r++) {
            if (!ok) continue;
            const float m = scale_row(logits + r * ld, vocab, temps[r], buf);
            if (!(m > -INFINITY)) { /* nothing drawable */
                out[r] = 0;
                continue;
            }
            int64_t k = top_k ? top_k[r] : vocab;
            k = k < 1 ? 1 : (k > vocab ? vocab : k);
            const float p = top_p ? top_p[r] : 1.0f;
            const float mp = min_p ? min_p[r] : 0.0f;
            if (k < vocab || p < 1.0f || mp > 0.0f)
                out[r] = draw_filtered(buf, vocab, m, k, p, mp, uniforms[r], cand);
            else
                out[r] = draw_all(buf, vocab, m, uniforms[r]);
        }
        free(buf);
        free(cand);
    }
    return failed;
}
