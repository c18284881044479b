/* Paged causal prefill attention on the CPU: each new token of a sequence against the
 * sequence's cached prefix and the new tokens up to itself, read straight from the paged
 * cache. Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: the torch path gathers each sequence's K/V out of the cache, widens them to fp32
 * and calls SDPA per sequence: on 2 cores, 16 prompts of 512 tokens spent 2.6 s of a 7.8 s
 * prefill there (~31 G multiply-adds a second), as long as all the layers' products.
 *
 * Work items: (sequence, KV head, 16 queries), run by OpenMP threads, costliest first. An
 * item's rows are its queries times the KV head's G query heads. Keys go 16 at a time: the
 * tile's K rows are widened and transposed once ([D][16], keys in lanes), so a row's 16
 * scores are D multiply-adds of a broadcast q value with a K column, no lane sums; then
 * the online softmax (a row's running max and sum, its output rescaled when the max
 * grows) and the 16 weighted V rows. A row stops at its own position (causal: query i of
 * a sequence of `len` tokens with `q_len` new sits at len - q_len + i). fp32 math, like the
 * torch path; sums run in another order, so results agree to fp32 rounding.
 *
 *   q        [T, Hq, D] fp32 or bf16 (q_bf16), packed new tokens; out the same
 *   k/v      [NB, BS, Hkv, D] fp32 or bf16, contiguous; or int8 [NB, BS, Hkv, D * 9 / 8]
 *            (codes, then the row's scales: vec16.h; D a multiple of 32), per cache_kind
 *   tables   [B, W] int32 or int64 (tables_i64), rows table_stride apart
 *   starts   [B + 1] int32 (query_start_loc), lens [B] int32 (prefix + new tokens)
 *   window   > 0: a sliding window, query position p sees keys p - window + 1 .. p
 *   softcap  > 0: each scaled score s becomes softcap * tanh(s / softcap) before the
 *            softmax (Gemma 2's logit soft-capping); 0: none
 * Returns 0; 1 for a shape it does not take (D not a multiple of 16 or above MAX_D, Hq
 * not a multiple of Hkv, more than MAX_G heads a group); NO_MEMORY; 16 + 2b when sequence
 * b's table is too short for its length or names a block outside the cache, 17 + 2b when
 * its new tokens outnumber its length (checked before anything is written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_lanes.h"

#define QT 16     /* queries a work item */
#define KT 16     /* keys a tile: a row's scores, NV vectors of LANES */
#define NV (KT / LANES)
#define MAX_D 256 /* head dims up to this, multiples of 16 */
#define MAX_G 16  /* query heads per KV head */
#define RB 4      /* rows a pass over a tile: each K column and V row loaded once for them */
#define NO_MEMORY 4

/* n scores soft-capped in place (cap > 0), vectorised (paged_decode_wide_cpu.c). */
int64_t softcap_scores(float *s, int64_t n, float cap);

static inline int64_t table_at(const void *tables, int i64, int64_t at) {
    return i64 ? ((const int64_t *)tables)[at] : ((const int32_t *)tables)[at];
}

typedef struct {
    const void *q, *k, *v, *tables;
    void *out;
    const int32_t *starts, *lens;
    int64_t hq, hkv, d, block_size, table_stride, window;
    float scale, softcap;
    int q_bf16, cache_kind, tables_i64;
} prefill_args;

/* Scratch of one thread (sized for G heads and D): the item's q rows and outputs, a K
 * tile transposed, a V tile, the rows' running max and sum. */
typedef struct {
    float *q, *o, *kt, *v, *m, *l;
} scratch;

static float *scratch_alloc(scratch *s, int64_t G, int64_t d) {
    /* RB - 1 rows past the most an item has: a last pass of RB rows may reach them (their
     * q and outputs zeros, their results never read). */
    const size_t rows = (size_t)(G * QT + RB - 1);
    const size_t n = 2 * rows * d + 2 * (size_t)(KT * d) + 2 * rows;
    float *mem = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (!mem) return NULL;
    s->q = mem;
    s->o = s->q + rows * d;
    s->kt = s->o + rows * d;
    s->v = s->kt + KT * d;
    s->m = s->v + KT * d;
    s->l = s->m + rows;
    return mem;
}

/* A work item and its cost (keys its last query sees), for ordering. */
typedef struct {
    int64_t keys, b, h, i0;
} item;

static int costlier_first(const void *x, const void *y) {
    const int64_t a = ((const item *)x)->keys, b = ((const item *)y)->keys;
    return (a < b) - (a > b);
}

/* Rows r .. r + n - 1 (n <= RB; query position first + row / G) against the tile's nk
 * keys from t0 (K transposed in s->kt, V in s->v): scores, online softmax, weighted V
 * rows. RB rows at a time share each load of a K column and a V row. A row sees keys
 * pos - W + 1 .. pos (W: the window, or more than any position); each row given sees
 * at least one key of the tile. cap > 0: scores soft-capped. */
static inline __attribute__((always_inline)) void attend_rows(
    scratch *s, int64_t r, int64_t n, int64_t first, int64_t G, int64_t t0, int64_t nk,
    int64_t d, int64_t W, float cap) {
    vf sc[RB][NV]; /* row j's KT scores, NV vectors of LANES */
    for (int j = 0; j < RB; j++)
        for (int h = 0; h < NV; h++) sc[j][h] = (vf){0};
    const float *q = s->q + r * d;
    for (int64_t c = 0; c < d; c++)
        for (int h = 0; h < NV; h++) {
            const vf kc = *(const vf *)(s->kt + c * KT + h * LANES);
            for (int j = 0; j < RB; j++) sc[j][h] += q[j * d + c] * kc; /* padded rows: 0 */
        }
    if (__builtin_expect(cap > 0, 0)) { /* before the masks: their -inf is set after */
        float t[RB * KT] __attribute__((aligned(64)));
        memcpy(t, sc, sizeof t);
        softcap_scores(t, RB * KT, cap);
        memcpy(sc, t, sizeof t);
    }
    float e[RB][KT] __attribute__((aligned(64))), corr[RB];
    for (int j = 0; j < RB; j++) {
        if (j >= n) {
            memset(e[j], 0, sizeof e[j]);
            corr[j] = 1.0f;
            continue;
        }
        const int64_t pos = first + (r + j) / G, see = pos - t0 + 1, from = pos - W + 1 - t0;
        const int32_t hi = (int32_t)(see < nk ? see : nk), lo = (int32_t)(from > 0 ? from : 0);
        vf x[NV];
        float bmax = -INFINITY;
        for (int h = 0; h < NV; h++) {
            const vi lane = lane_ids(h * LANES);
            x[h] = VSEL((lane < hi) & (lane >= lo), sc[j][h], (vf){0} - INFINITY);
            for (int k = 0; k < LANES; k++) bmax = x[h][k] > bmax ? x[h][k] : bmax;
        }
        const float m = s->m[r + j], mnew = m > bmax ? m : bmax;
        corr[j] = expf(m - mnew); /* exp(-inf) = 0 at the start */
        float sum = 0.0f;
        for (int h = 0; h < NV; h++) {
            const vf ev = VEXP(x[h] - mnew);
            for (int k = 0; k < LANES; k++) sum += ev[k];
            memcpy(e[j] + h * LANES, &ev, sizeof ev);
        }
        s->l[r + j] = s->l[r + j] * corr[j] + sum;
        s->m[r + j] = mnew;
    }
    /* KT columns a pass (d is a multiple): RB x NV independent sums, enough to keep the
     * FMA units busy on 8 lanes too (RB alone left them half idle, waiting on latency). */
    for (int64_t c = 0; c < d; c += KT) {
        vf acc[RB][NV];
        for (int j = 0; j < RB; j++)
            for (int h = 0; h < NV; h++)
                acc[j][h] = *(const vf *)(s->o + (r + j) * d + c + h * LANES) * corr[j];
        for (int64_t u = 0; u < nk; u++) {
            vf vr[NV];
            for (int h = 0; h < NV; h++) vr[h] = *(const vf *)(s->v + u * d + c + h * LANES);
            for (int j = 0; j < RB; j++)
                for (int h = 0; h < NV; h++) acc[j][h] += e[j][u] * vr[h];
        }
        for (int j = 0; j < RB; j++)
            for (int h = 0; h < NV; h++) *(vf *)(s->o + (r + j) * d + c + h * LANES) = acc[j][h];
    }
}

/* One work item: sequence b's queries i0 .. i0 + nq - 1 (of its new tokens), KV head h. */
static void attend_item(const prefill_args *a, int64_t b, int64_t h, int64_t i0,
                        scratch *s) {
    const int64_t d = a->d, G = a->hq / a->hkv;
    const int64_t start = a->starts[b], q_len = a->starts[b + 1] - start, len = a->lens[b];
    const int64_t nq = q_len - i0 < QT ? q_len - i0 : QT, rows = nq * G;
    const int64_t padded = rows + RB - 1; /* rows a last pass of RB may touch */
    const int64_t first = len - q_len + i0; /* position of the item's first query */
    const int i8 = a->cache_kind == KV_INT8, cache_bf16 = a->cache_kind == KV_BF16;
    const int64_t hs = i8 ? kv_int8_row(d) : d; /* cache elements a head's row */
    const int64_t row = a->hkv * hs;                /* cache elements a token */
    const void *tables = (const char *)a->tables +
                         (size_t)(b * a->table_stride) * (a->tables_i64 ? 8 : 4);
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t src = ((start + i0 + i) * a->hq + h * G + g) * d, r = i * G + g;
            for (int64_t c = 0; c < d; c++)
                s->q[r * d + c] = load1(a->q, src + c, a->q_bf16) * a->scale;
            memset(s->o + r * d, 0, (size_t)d * sizeof(float));
            s->m[r] = -INFINITY;
            s->l[r] = 0.0f;
        }
    memset(s->q + rows * d, 0, (size_t)((padded - rows) * d) * sizeof(float));
    memset(s->o + rows * d, 0, (size_t)((padded - rows) * d) * sizeof(float));
    const int64_t keys = first + nq; /* the last query sees keys 0 .. first + nq - 1 */
    /* A sliding window: the first query sees keys from first - W + 1, none before. */
    const int64_t W = a->window > 0 ? a->window : keys + KT;
    const int64_t lo = first - W + 1 > 0 ? first - W + 1 : 0;
    for (int64_t t0 = lo / KT * KT; t0 < keys; t0 += KT) {
        const int64_t nk = keys - t0 < KT ? keys - t0 : KT;
        for (int64_t u = 0; u < KT; u++) {
            if (u >= nk) {
                for (int64_t c = 0; c < d; c++) s->kt[c * KT + u] = 0.0f;
                memset(s->v + u * d, 0, (size_t)d * sizeof(float));
                continue;
            }
            const int64_t t = t0 + u;
            const int64_t blk = table_at(tables, a->tables_i64, t / a->block_size);
            const int64_t off = (blk * a->block_size + t % a->block_size) * row + h * hs;
            if (i8) { /* values widened once a tile: code * its group's scale */
                const int8_t *kr = (const int8_t *)a->k + off, *vr8 = (const int8_t *)a->v + off;
                for (int64_t g = 0; g < d / KV_GROUP; g++) {
                    const float ks = kv_scale(kr, d, g), vs = kv_scale(vr8, d, g);
                    for (int64_t c = g * KV_GROUP; c < (g + 1) * KV_GROUP; c++)
                        s->kt[c * KT + u] = (float)kr[c] * ks;
                    for (int64_t c = g * KV_GROUP; c < (g + 1) * KV_GROUP; c += LANES) {
                        const vf vr = VLOAD_I8(vr8 + c) * vs;
                        memcpy(s->v + u * d + c, &vr, sizeof vr);
                    }
                }
                continue;
            }
            for (int64_t c = 0; c < d; c++)
                s->kt[c * KT + u] = load1(a->k, off + c, cache_bf16);
            for (int64_t c = 0; c < d; c += LANES) {
                const vf vr = VLOAD(a->v, off + c, cache_bf16);
                memcpy(s->v + u * d + c, &vr, sizeof vr);
            }
        }
        /* Rows in query order: those whose position reaches this tile are a suffix. */
        const int64_t from = t0 <= first ? 0 : (t0 - first) * G;
        /* ... and those whose window starts past the tile, a suffix too, skip it. */
        int64_t to = (t0 + nk - 1 + W - first) * G;
        if (to > rows) to = rows;
        for (int64_t r = from; r < to; r += RB)
            attend_rows(s, r, to - r < RB ? to - r : RB, first, G, t0, nk, d, W, a->softcap);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / G, g = r % G;
        const int64_t dst = ((start + i0 + i) * a->hq + h * G + g) * d;
        const float inv = 1.0f / s->l[r];
        for (int64_t c = 0; c < d; c++)
            store1(a->out, dst + c, s->o[r * d + c] * inv, a->q_bf16);
    }
}

int64_t paged_prefill_attention_cpu(const void *q, int32_t q_bf16, const void *k_cache,
                                    const void *v_cache, int32_t cache_kind,
                                    const void *tables, int32_t tables_i64, int64_t table_width,
                                    int64_t table_stride, const int32_t *starts,
                                    const int32_t *lens, int64_t batch, int64_t hq, int64_t hkv,
                                    int64_t d, int64_t num_blocks, int64_t block_size,
                                    float scale, void *out, int64_t window, float softcap,
                                    int32_t threads) {
    if (d <= 0 || d % 16 || d > MAX_D || hkv <= 0 || hq % hkv || hq / hkv > MAX_G ||
        block_size <= 0 || cache_kind < KV_F32 || cache_kind > KV_INT8 ||
        (cache_kind == KV_INT8 && d % KV_GROUP))
        return 1;
    /* Every table entry a sequence will read names a block of the cache, before any work. */
    int64_t items = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t q_len = starts[b + 1] - starts[b], len = lens[b];
        if (q_len < 0 || q_len > len) return 17 + 2 * b;
        if (!q_len) continue;
        const int64_t need = (len + block_size - 1) / block_size;
        if (need > table_width) return 16 + 2 * b;
        const void *row = (const char *)tables + (size_t)(b * table_stride) * (tables_i64 ? 8 : 4);
        for (int64_t j = 0; j < need; j++) {
            const int64_t blk = table_at(row, tables_i64, j);
            if (blk < 0 || blk >= num_blocks) return 16 + 2 * b;
        }
        items += (q_len + QT - 1) / QT * hkv;
    }
    if (!items) return 0;
    /* Items, costliest first (dynamic scheduling then ends with the short ones). */
    item *work = malloc((size_t)items * sizeof(item));
    if (!work) return NO_MEMORY;
    int64_t n = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t q_len = starts[b + 1] - starts[b], len = lens[b];
        for (int64_t i0 = 0; i0 < q_len; i0 += QT)
            for (int64_t h = 0; h < hkv; h++) {
                const int64_t nq = q_len - i0 < QT ? q_len - i0 : QT;
                work[n++] = (item){len - q_len + i0 + nq, b, h, i0};
            }
    }
    qsort(work, (size_t)items, sizeof(item), costlier_first);
    const prefill_args a = {q, k_cache, v_cache, tables, out, starts, lens, hq, hkv, d,
                            block_size, table_stride, window, scale, softcap, q_bf16,
                            cache_kind, tables_i64};
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch s;
        float *mem = scratch_alloc(&s, hq / hkv, d);
        failed = mem == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            attend_item(&a, work[it].b, work[it].h, work[it].i0, &s);
        }
        free(mem);
    }
    free(work);
    return failed ? NO_MEMORY : 0;
}
