/* A whole decode step's decoder layers in one call: for each layer, RMSNorm (with the
 * residual add), the q/k/v product, RoPE (with per-head q/k norm), the K/V store, paged
 * decode attention, the output product, RMSNorm, gate/up, SiLU-and-mul, down; then the
 * final norm. Built with the other C kernels by kernels/cpu_native.py.
 *
 * Why: with the weights kept as GGUF blocks a small model's layer reads ~3 MB, about
 * 0.15 ms at memory speed, while the ~12 Python calls of a layer cost ~0.1 ms more
 * (ctypes argument conversion, tensor allocation, dispatch checks). One call per step
 * leaves the memory reads.
 *
 * It calls the same kernels, in the same order, with the same roundings as the layer-by-
 * layer path (deepinfer_kernels.cpu_backend over layers holding GGUF blocks), so the two
 * give the same bits; only the glue between them moved here.
 *
 *   model   [MODEL_FIELDS] int64: hidden, q heads, kv heads, head dim, intermediate,
 *           bf16 activations, final norm weight, cos/sin cache [max_pos, d], max_pos,
 *           the most rows the int8 kernel takes where the bf16 GEMM exists
 *           (cpu_gguf.INT8_MAX_M)
 *   layers  [num_layers, LAYER_FIELDS] int64: the norms' pointers, then each projection's
 *           parts (the enums below)
 *   x       [t, hidden] the embeddings (activation dtype); out [t, hidden] the result
 *   residual each attention and MLP output is multiplied by it before its residual add
 *           (Granite's residual_multiplier; 1 elsewhere), rounded to the activation dtype
 *           as the layer-by-layer path's multiply rounds it
 *   kv      [num_layers, 2, num_blocks, block_size, kv heads, head dim] contiguous cache
 *           in the activation dtype, or with kv_int8 an int8 one whose last dim is head
 *           dim * 9 / 8 (each row's codes and scales, vec16.h)
 * Returns 0, or the first failing kernel's nonzero code (the caller reruns the step layer
 * by layer to name the bad input: every write before the failure is one the rerun
 * repeats with the same values).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

int64_t gguf_int8_types(void);
int64_t gguf_matmul_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                        const uint8_t *w, int64_t n, int64_t ldw, int32_t qtype, void *out,
                        int64_t ldo, int32_t out_bf16, int32_t threads);
int64_t gguf_matmul_int8_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                             const uint8_t *w, int64_t n, int64_t ldw, int32_t qtype,
                             void *out, int64_t ldo, int32_t out_bf16, int32_t threads);
int64_t gguf_gemm_bf16_available(void);
int64_t gguf_rows16_matmul(const void *x, int64_t m, int64_t k, int64_t ldx, int32_t x_bf16,
                           const uint8_t *w, int64_t n, int32_t qtype, void *out, int64_t ldo,
                           int32_t out_bf16, int32_t threads);
int64_t gguf_gemm_bf16_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w,
                           int64_t n, int64_t ldw, int32_t qtype, void *out, int64_t ldo,
                           int32_t out_bf16, int32_t threads);
int64_t dense_gemm_bf16_cpu(const void *x, int64_t m, int64_t k, int64_t ldx, const void *w,
                            int64_t n, int64_t ldw, void *out, int64_t ldo, int32_t out_bf16,
                            int32_t threads);
int64_t rms_norm_cpu(const void *x, int64_t ldx, const void *res_in, int64_t ld_rin,
                     void *res_out, int64_t ld_rout, const void *w, void *out, int64_t ldo,
                     int64_t t, int64_t h, float eps, int32_t bf16, int32_t threads);
int64_t rotary_qk_cpu(const void *q, int64_t ldq, const void *k, int64_t ldk, void *q_out,
                      int64_t ld_qo, void *k_out, int64_t ld_ko, int64_t t, int64_t hq,
                      int64_t hkv, int64_t d, const void *cos_sin, int64_t max_pos,
                      const int64_t *positions, const void *qw, const void *kw, float eps,
                      int32_t bf16, int32_t threads);
int64_t silu_and_mul_cpu(const void *x, int64_t ldx, void *out, int64_t ldo, int64_t t,
                         int64_t inter, int32_t bf16, int32_t threads);
int64_t store_kv_cpu(const void *k, int64_t ldk, const void *v, int64_t ldv, void *k_cache,
                     void *v_cache, const int64_t *slots, int64_t t, int64_t row,
                     int64_t num_slots, int32_t elem_bytes);
int64_t store_kv_int8_cpu(const void *k, int64_t ldk, const void *v, int64_t ldv,
                          void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
                          int64_t hkv, int64_t d, int64_t num_slots, int32_t src_bf16);
int64_t paged_decode_attention_cpu(
    const float *q, const void *k_cache, const void *v_cache, const void *block_tables,
    const int32_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
    int64_t num_kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size,
    int64_t table_width, int64_t table_stride, int32_t cache_kind,
    int32_t tables_are_int64, int64_t window, float softcap, int32_t num_threads);

enum { M_HIDDEN, M_HQ, M_HKV, M_DIM, M_INTER, M_BF16, M_FINAL_NORM, M_COS_SIN, M_MAX_POS,
       M_INT8_MAX_M, MODEL_FIELDS };
/* A projection is up to MAX_PARTS parts, each (pointer, row stride, type, rows), stacked
 * along the output in order; unused parts have 0 rows. Parts differ in type where
 * llama.cpp's mixed presets store attn_v or ffn_up a type above the rest. */
#define MAX_PARTS 3
#define PART_FIELDS 4
#define PROJ_FIELDS (MAX_PARTS * PART_FIELDS)
enum { L_IN_NORM, L_POST_NORM, L_Q_NORM, L_K_NORM, L_QKV, L_O = L_QKV + PROJ_FIELDS,
       L_GATE_UP = L_O + PROJ_FIELDS, L_DOWN = L_GATE_UP + PROJ_FIELDS,
       L_WINDOW = L_DOWN + PROJ_FIELDS, /* the layer's sliding window (0: none) */
       L_ROPE, /* 1: RoPE rotates q and k; 0: a NoPE layer (SmolLM3's), none */
       LAYER_FIELDS };
#define NO_MEMORY 3
#define BAD_TYPE 1
#define BF16_TYPE 30 /* ggml's BF16: a dense bf16 weight, row stride in elements */
#define ROWS16_FLAG 256 /* or-ed into a type: blocks repacked in 16-row groups */

int64_t decoder_stack_fields(void) { return MODEL_FIELDS * 100 + LAYER_FIELDS; }

#define P(v) ((void *)(intptr_t)(v))

/* x [m, k] @ W.T -> out [m, n] with row stride ldo, the kernel the per-layer path picks:
 * the row-group kernel for a packed weight (cpu_gguf_rows16.py); else, as
 * cpu_gguf.py:_uses_gemm, int8 activations for up to int8_max_m bf16 rows where this CPU
 * and type have them (any number without the bf16 GEMM: the caller keeps m below LARGE_M
 * there), the bf16 GEMM for 2 or more bf16 rows otherwise, else the exact one (fp32
 * activations: the caller keeps m below cpu_gguf.tile_min_rows, 33); a dense
 * bf16 weight always takes the dense GEMM (cpu_dense.py: below PACKED_MIN_M rows, which
 * the caller keeps to). */
typedef struct {
    int bf16, gemm, threads;           /* activations, the bf16 GEMM built, threads */
    int64_t int8_mask, int8_max_m;     /* types with the int8 kernel, and its most rows */
} kernel_choice;

static int64_t product(const void *x, int64_t m, int64_t k, const int64_t *w, int64_t n,
                       void *out, int64_t ldo, const kernel_choice *c) {
    const uint8_t *blocks = P(w[0]);
    int64_t ldw = w[1];
    int32_t qtype = (int32_t)w[2];
    const int bf16 = c->bf16, threads = c->threads;
    if (qtype & ROWS16_FLAG)
        return gguf_rows16_matmul(x, m, k, k, bf16, blocks, n, qtype & ~ROWS16_FLAG, out, ldo,
                                  bf16, threads);
    if (qtype == BF16_TYPE)
        return bf16 ? dense_gemm_bf16_cpu(x, m, k, k, blocks, n, ldw, out, ldo, 1, threads)
                    : BAD_TYPE;
    if (bf16 && ((c->int8_mask >> qtype) & 1) && (m <= c->int8_max_m || !c->gemm))
        return gguf_matmul_int8_cpu(x, m, k, k, bf16, blocks, n, ldw, qtype, out, ldo, bf16,
                                    threads);
    if (c->gemm && m >= 2)
        return gguf_gemm_bf16_cpu(x, m, k, k, blocks, n, ldw, qtype, out, ldo, 1, threads);
    return gguf_matmul_cpu(x, m, k, k, bf16, blocks, n, ldw, qtype, out, ldo, bf16, threads);
}

/* A projection x [m, k] -> out [m, n]: each part's product into its columns, as the
 * per-layer path concatenates them (the same kernel per part, so the same bits). */
static int64_t projection(const void *x, int64_t m, int64_t k, const int64_t *parts,
                          int64_t n, void *out, const kernel_choice *c) {
    const size_t es = c->bf16 ? 2 : 4;
    int64_t row = 0;
    for (int j = 0; j < MAX_PARTS; j++) {
        const int64_t *w = parts + j * PART_FIELDS;
        if (w[3] == 0) break;
        int64_t rc = product(x, m, k, w, w[3], (char *)out + (size_t)row * es, n, c);
        if (rc) return rc;
        row += w[3];
    }
    return row == n ? 0 : BAD_TYPE;
}

/* x[e] *= r for e < n, each product rounded to the activation dtype. */
static void scale_rows(void *x, int64_t n, float r, int bf16) {
    for (int64_t e = 0; e < n; e++) store1(x, e, load1(x, e, bf16) * r, bf16);
}

int64_t decoder_stack_cpu(const int64_t *model, const int64_t *layers, int64_t num_layers,
                          const void *x, void *out, int64_t t, const int64_t *positions,
                          const int64_t *slots, void *kv, int64_t num_blocks,
                          int64_t block_size, const void *tables, int64_t table_width,
                          int64_t table_stride, int32_t tables_i64, const int32_t *seq_lens,
                          float eps, float scale, float residual, int32_t kv_int8,
                          int32_t threads) {
    const int64_t h = model[M_HIDDEN], hq = model[M_HQ], hkv = model[M_HKV], d = model[M_DIM];
    const int64_t inter = model[M_INTER], max_pos = model[M_MAX_POS];
    const int bf16 = (int)model[M_BF16];
    const size_t es = bf16 ? 2 : 4;
    const int64_t qs = hq * d, kvs = hkv * d, qkv_n = qs + 2 * kvs;
    const kernel_choice how = {bf16, bf16 && gguf_gemm_bf16_available() != 0, threads,
                               bf16 ? gguf_int8_types() : 0, model[M_INT8_MAX_M]};
    /* Activation-dtype buffers (element counts), then the two fp32 ones of attention. */
    const int64_t n_res = t * h, n_cur = t * h, n_h = t * h, n_qkv = t * qkv_n,
                  n_qrot = t * qs, n_krot = t * kvs, n_attn = t * qs, n_gu = t * 2 * inter,
                  n_act = t * inter;
    size_t act_elems = (size_t)(n_res + n_cur + n_h + n_qkv + n_qrot + n_krot + n_attn +
                                n_gu + n_act);
    char *mem = malloc(act_elems * es + (size_t)(2 * t * qs) * sizeof(float) + 64);
    if (!mem) return NO_MEMORY;
    char *p = mem;
#define TAKE(n) (p += (size_t)(n) * es, p - (size_t)(n) * es)
    void *res = TAKE(n_res), *cur = TAKE(n_cur), *hb = TAKE(n_h), *qkv = TAKE(n_qkv);
    void *qrot = TAKE(n_qrot), *krot = TAKE(n_krot), *attn = TAKE(n_attn);
    void *gu = TAKE(n_gu), *act = TAKE(n_act);
#undef TAKE
    float *qf = (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63), *attn_f = qf + t * qs;
    /* One layer's K (or V) cache, in bytes; the element kind the kernels read. */
    const size_t cache_bytes = (size_t)(num_blocks * block_size * hkv) *
                               (kv_int8 ? (size_t)kv_int8_row(d) : (size_t)d * es);
    const int32_t kv_kind = kv_int8 ? KV_INT8 : bf16 ? KV_BF16 : KV_F32;
    const int64_t num_slots = num_blocks * block_size;
    const void *cos_sin = P(model[M_COS_SIN]);
    int64_t rc = 0;
    memcpy(res, x, (size_t)n_res * es); /* the stream before layer 0: the embeddings */
    for (int64_t i = 0; i < num_layers && rc == 0; i++) {
        const int64_t *L = layers + i * LAYER_FIELDS;
        char *k_cache = (char *)kv + (size_t)(2 * i) * cache_bytes;
        char *v_cache = k_cache + cache_bytes;
        if (i == 0)
            rc = rms_norm_cpu(x, h, NULL, 0, NULL, 0, P(L[L_IN_NORM]), hb, h, t, h, eps, bf16,
                              threads);
        else
            rc = rms_norm_cpu(cur, h, res, h, res, h, P(L[L_IN_NORM]), hb, h, t, h, eps, bf16,
                              threads);
        if (!rc) rc = projection(hb, t, h, L + L_QKV, qkv_n, qkv, &how);
        if (!rc && L[L_ROPE])
            rc = rotary_qk_cpu(qkv, qkv_n, (char *)qkv + (size_t)qs * es, qkv_n, qrot, qs,
                               krot, kvs, t, hq, hkv, d, cos_sin, max_pos, positions,
                               P(L[L_Q_NORM]), P(L[L_K_NORM]), eps, bf16, threads);
        else if (!rc) /* NoPE: q and k as projected, packed as the rotary kernel packs */
            for (int64_t r = 0; r < t; r++) {
                const char *row = (const char *)qkv + (size_t)(r * qkv_n) * es;
                memcpy((char *)qrot + (size_t)(r * qs) * es, row, (size_t)qs * es);
                memcpy((char *)krot + (size_t)(r * kvs) * es, row + (size_t)qs * es,
                       (size_t)kvs * es);
            }
        if (!rc && kv_int8)
            rc = store_kv_int8_cpu(krot, kvs, (char *)qkv + (size_t)(qs + kvs) * es, qkv_n,
                                   k_cache, v_cache, slots, t, hkv, d, num_slots, bf16);
        else if (!rc)
            rc = store_kv_cpu(krot, kvs, (char *)qkv + (size_t)(qs + kvs) * es, qkv_n,
                              k_cache, v_cache, slots, t, kvs, num_slots, (int32_t)es);
        if (rc) break;
        for (int64_t e = 0; e < t * qs; e++) qf[e] = load1(qrot, e, bf16) * scale;
        rc = paged_decode_attention_cpu(qf, k_cache, v_cache, tables, seq_lens, attn_f, t,
                                        hq, hkv, d, num_blocks, block_size, table_width,
                                        table_stride, kv_kind, tables_i64, L[L_WINDOW],
                                        0.0f, threads); /* no soft-capped model runs here */
        if (rc) break;
        for (int64_t e = 0; e < t * qs; e++) store1(attn, e, attn_f[e], bf16);
        rc = projection(attn, t, qs, L + L_O, h, cur, &how);
        if (!rc && residual != 1.0f) scale_rows(cur, t * h, residual, bf16);
        if (!rc)
            rc = rms_norm_cpu(cur, h, res, h, res, h, P(L[L_POST_NORM]), hb, h, t, h, eps,
                              bf16, threads);
        if (!rc)
            rc = projection(hb, t, h, L + L_GATE_UP, 2 * inter, gu, &how);
        if (!rc) rc = silu_and_mul_cpu(gu, 2 * inter, act, inter, t, inter, bf16, threads);
        if (!rc) rc = projection(act, t, inter, L + L_DOWN, h, cur, &how);
        if (!rc && residual != 1.0f) scale_rows(cur, t * h, residual, bf16);
    }
    if (!rc && num_layers > 0)
        rc = rms_norm_cpu(cur, h, res, h, res, h, P(model[M_FINAL_NORM]), out, h, t, h, eps,
                          bf16, threads);
    else if (!rc)
        rc = rms_norm_cpu(x, h, NULL, 0, NULL, 0, P(model[M_FINAL_NORM]), out, h, t, h, eps,
                          bf16, threads);
    free(mem);
    return rc;
}
