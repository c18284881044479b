/* GGUF weights between row-major blocks and the 16-row groups of gguf_rows16.h: the
 * repacking in place at load, its inverse, and an embedding's row lookup out of the
 * groups. Built with the other C kernels by kernels/cpu_native.py. */
#include <stdlib.h>
#include <string.h>

#include "gguf_rows16.h"

/* Bit i set: ggml type id i has a row-group kernel in this build (none without AVX2;
 * Q6_K with AVX2 alone, or with AVX512-VNNI where AVX512-BF16 gives its many-row path). */
int64_t gguf_rows16_types(void) {
#ifdef HAVE_ROWS16
    int64_t t = (1 << Q4_0) | (1 << Q4_1) | (1 << Q5_0) | (1 << Q5_1) | (1 << Q8_0) |
                (1 << Q4_K) | (1 << Q5_K);
#if defined(ROWS16_AVX2) || defined(__AVX512BF16__)
    t |= 1 << Q6_K;
#endif
    return t;
#else
    return 0;
#endif
}

/* One chunk (16 rows' block b) between row-major blocks and the packed layout. `rows`:
 * the 16 rows' block b, row_bytes apart; `chunk`: its 16 x bb packed bytes. */
static void pack_chunk(const uint8_t *rows, int64_t row_bytes, int32_t qtype, uint8_t *chunk) {
    layout l;
    layout_of(qtype, &l);
    uint8_t *words = chunk + 32 * l.halves;
    for (int64_t i = 0; i < GROUP; i++) {
        const uint8_t *blk = rows + i * row_bytes;
        for (int64_t h = 0; h < l.halves; h++)
            memcpy(chunk + h * 32 + 2 * i, blk + l.half_at + 2 * h, 2);
        for (int64_t v = 0; v < l.words; v++)
            for (int64_t j = 0; j < 4; j++)
                words[v * 64 + 4 * i + j] = blk[l.word_at + 4 * v + j] ^ l.flip;
    }
}

/* Row i (0..15) of a chunk back to its row-major block `blk`. */
static void unpack_row(const uint8_t *chunk, int32_t qtype, int64_t i, uint8_t *blk) {
    layout l;
    layout_of(qtype, &l);
    const uint8_t *words = chunk + 32 * l.halves;
    for (int64_t h = 0; h < l.halves; h++)
        memcpy(blk + l.half_at + 2 * h, chunk + h * 32 + 2 * i, 2);
    for (int64_t v = 0; v < l.words; v++)
        for (int64_t j = 0; j < 4; j++)
            blk[l.word_at + 4 * v + j] = words[v * 64 + 4 * i + j] ^ l.flip;
}

static void unpack_chunk(const uint8_t *chunk, int32_t qtype, uint8_t *rows, int64_t row_bytes) {
    for (int64_t i = 0; i < GROUP; i++) unpack_row(chunk, qtype, i, rows + i * row_bytes);
}

/* Rows ids[0..t) of a packed w [n, k] as row-major blocks into out [t, row_bytes] (an
 * embedding's lookup). Returns 0, BAD_TYPE, BAD_SHAPE, or 5 + the first id's position
 * when an id is outside 0..n-1 (nothing written for it). */
int64_t gguf_rows16_gather(const uint8_t *w, int64_t n, int64_t k, int32_t qtype,
                           const int64_t *ids, int64_t t, uint8_t *out) {
    int64_t nb, bb, rc = geometry(qtype, n, k, &nb, &bb);
    if (rc) return rc;
    const int64_t row_bytes = nb * bb;
    for (int64_t r = 0; r < t; r++) {
        const int64_t id = ids[r];
        if (id < 0 || id >= n) return 5 + r;
        const uint8_t *grp = w + (id / GROUP) * GROUP * row_bytes;
        for (int64_t b = 0; b < nb; b++)
            unpack_row(grp + b * GROUP * bb, qtype, id % GROUP, out + r * row_bytes + b * bb);
    }
    return 0;
}

/* Row-major blocks w [n, k / block weights] (rows contiguous) to the
 * packed layout in place (unpack: back). Returns 0, BAD_TYPE, BAD_SHAPE (n not whole
 * groups, k not whole blocks) or NO_MEMORY. */
int64_t gguf_rows16_pack(uint8_t *w, int64_t n, int64_t k, int32_t qtype, int32_t unpack,
                         int32_t threads) {
    int64_t nb, bb, rc = geometry(qtype, n, k, &nb, &bb);
    if (rc) return rc;
    const int64_t row_bytes = nb * bb, groups = n / GROUP;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint8_t *tmp = malloc((size_t)(GROUP * row_bytes));
        failed = tmp == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            uint8_t *base = w + g * GROUP * row_bytes;
            memcpy(tmp, base, (size_t)(GROUP * row_bytes));
            for (int64_t b = 0; b < nb; b++) {
                if (unpack)
                    unpack_chunk(tmp + b * GROUP * bb, qtype, base + b * bb, row_bytes);
                else
                    pack_chunk(tmp + b * bb, row_bytes, qtype, base + b * GROUP * bb);
            }
        }
        free(tmp);
    }
    return failed ? NO_MEMORY : 0;
}
