/* Decode attention in float32, read in place from the paged KV cache: one query token per row (a
   GQA group of `group` query heads per KV head) against that row's own keys.

   Each row walks its block table: it reads each token's (Hkv, D) record of K once for all the row's
   query heads, runs an exact two-pass softmax over the row's own length (no padding, no mask), then
   reads V the same way, prefetching the next block. Rows are split over torch's OpenMP threads.
   FP8 caches (k_lut/v_lut not NULL): the cache holds one byte per value, and each token's record is
   widened through the layer's 256-entry table (byte -> value * scale) into a float row before the
   same loops run: a quarter of the bytes read. bfloat16 caches (cache_bf16): each record is widened
   by a 16-bit shift the same way, half the bytes. q and out may be bfloat16 too (io_bf16): a row's
   queries are widened once, its outputs accumulated in float32 and rounded to nearest even at the
   end. Called from kernels/cpu_paged_attention.py, which checks every argument first. */

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "bf16.h"

typedef struct {
    const void *q;  /* float32, or bfloat16 with io_bf16 (out likewise) */
    const void *k_cache, *v_cache;  /* float32, bfloat16 (cache_bf16), or FP8 bytes when the tables below are set */
    const float *k_lut, *v_lut;  /* (256,) byte -> value * scale, or NULL */
    const int *lengths, *block_tables;
    void *out;
    int num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
    int cache_bf16, io_bf16;
} job_t;

/* Block `i` of a row's table, as a pointer to its first token's (Hkv, D) record, or 0 past the row.
   `elem`: bytes per cached value (4 float32, 2 bfloat16, 1 FP8). */
static const char *block_at(const void *cache, const int *table, int i, int length, int block_size,
                            long token_stride, int elem) {
    return i * block_size < length ? (const char *)cache + (long)table[i] * block_size * token_stride * elem : 0;
}

/* Ask for the next block while this one is read: a row's blocks are scattered through the cache
   (decode blocks are allocated one at a time), so the hardware prefetcher loses the stream at every
   block. Into L2 (hint 1), which measured faster than L1 (benchmarks/NOTES.md). One per 64 bytes. */
static void prefetch_token(const char *next_block, int t, long token_stride, int elem) {
    if (!next_block) return;
    const long bytes = token_stride * elem;
    for (long c = 0; c < bytes; c += 64) __builtin_prefetch(next_block + t * bytes + c, 0, 1);
}

/* Token t's (Hkv, D) record as floats: in place for a float32 cache, widened into `row` for FP8
   (through the table) and bfloat16 (by a shift). */
static const float *token_record(const char *block, int t, long token_stride, const float *lut, int is_bf16,
                                 float *row) {
    if (lut) {
        const unsigned char *codes = (const unsigned char *)block + t * token_stride;
        for (long c = 0; c < token_stride; c++) row[c] = lut[codes[c]];
        return row;
    }
    if (is_bf16) {
        widen_bf16((const bf16_t *)block + t * token_stride, row, token_stride);
        return row;
    }
    return (const float *)block + t * token_stride;
}

/* One row, all its KV heads: each token's (Hkv, D) record is read once, contiguously. q, out:
   (Hkv, G, D); scores: (Hkv * G, L); qo: 2 x (Hkv * G * D) floats for bfloat16 queries and outputs. */
static void attend_row(const job_t *j, int b, float *scores, float *row, float *qo) {
    const int H = j->num_kv_heads, G = j->group, D = j->head_dim, BS = j->block_size;
    const int L = j->lengths[b], HG = H * G;
    const long token_stride = (long)H * D;
    const int *table = j->block_tables + (long)b * j->max_blocks;
    const int cache_elem = j->cache_bf16 ? 2 : 4;
    const int k_elem = j->k_lut ? 1 : cache_elem, v_elem = j->v_lut ? 1 : cache_elem;
    const float *q;
    float *out;
    if (j->io_bf16) {
        widen_bf16((const bf16_t *)j->q + (long)b * HG * D, qo, (long)HG * D);
        q = qo;
        out = qo + (long)HG * D;
    } else {
        q = (const float *)j->q + (long)b * HG * D;
        out = (float *)j->out + (long)b * HG * D;
    }
    for (int i = 0; i * BS < L; i++) {
        const char *block = block_at(j->k_cache, table, i, L, BS, token_stride, k_elem);
        const char *next = block_at(j->k_cache, table, i + 1, L, BS, token_stride, k_elem);
        const int n = L - i * BS < BS ? L - i * BS : BS;
        for (int t = 0; t < n; t++) {
            prefetch_token(next, t, token_stride, k_elem);
            const float *key = token_record(block, t, token_stride, j->k_lut, j->cache_bf16, row);
            for (int hg = 0; hg < HG; hg++) {
                const float *qh = q + hg * D, *kh = key + (hg / G) * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qh[d] * kh[d];
                scores[hg * L + i * BS + t] = s * j->scale;
            }
        }
    }
    for (int hg = 0; hg < HG; hg++) {  /* exact softmax over the row's own keys */
        float *sh = scores + hg * L, m = -FLT_MAX, sum = 0.f;
        for (int l = 0; l < L; l++) m = sh[l] > m ? sh[l] : m;
        for (int l = 0; l < L; l++) { sh[l] = expf(sh[l] - m); sum += sh[l]; }
        const float inv = 1.f / sum;
        for (int l = 0; l < L; l++) sh[l] *= inv;
        for (int d = 0; d < D; d++) out[hg * D + d] = 0.f;
    }
    for (int i = 0; i * BS < L; i++) {
        const char *block = block_at(j->v_cache, table, i, L, BS, token_stride, v_elem);
        const char *next = block_at(j->v_cache, table, i + 1, L, BS, token_stride, v_elem);
        const int n = L - i * BS < BS ? L - i * BS : BS;
        for (int t = 0; t < n; t++) {
            prefetch_token(next, t, token_stride, v_elem);
            const float *value = token_record(block, t, token_stride, j->v_lut, j->cache_bf16, row);
            for (int hg = 0; hg < HG; hg++) {
                const float p = scores[hg * L + i * BS + t], *vh = value + (hg / G) * D;
                float *oh = out + hg * D;
                for (int d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
    if (j->io_bf16) narrow_bf16(out, (bf16_t *)j->out + (long)b * HG * D, (long)HG * D);
}

/* Returns 0 on success. q, out: (rows, Hkv, group, D) contiguous, float32 or (io_bf16) bfloat16;
   k_cache, v_cache: (slots, Hkv, D) contiguous, slot = block * block_size + offset, float32,
   bfloat16 (cache_bf16) or (with k_lut, v_lut) FP8 bytes; block_tables: (rows, max_blocks). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const float *k_lut, const float *v_lut, const int *lengths, const int *block_tables, void *out,
                           int num_rows, int num_kv_heads, int group, int head_dim,
                           int block_size, int max_blocks, float scale, int cache_bf16, int io_bf16,
                           int num_threads) {
    int max_len = 1;
    for (int b = 0; b < num_rows; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    const job_t j = {q, k_cache, v_cache, k_lut, v_lut, lengths, block_tables, out, num_kv_heads, group, head_dim,
                     block_size, max_blocks, scale, cache_bf16, io_bf16};
    const size_t qo_floats = io_bf16 ? 2 * (size_t)num_kv_heads * group * head_dim : 1;
    int failed = 0;
    /* OpenMP from torch's own libgomp (same soname, already loaded): torch's worker threads, which
       are still spinning after the previous op, take the rows; no second thread pool competes.
       Rows differ in length: dynamic scheduling keeps both threads busy to the end. */
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_kv_heads * group * (size_t)max_len);
        float *row = (float *)malloc(sizeof(float) * (size_t)num_kv_heads * head_dim);  /* a widened record */
        float *qo = (float *)malloc(sizeof(float) * qo_floats);  /* widened queries, float32 outputs */
        if (!scores || !row || !qo) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < num_rows; b++)
            if (scores && row && qo) attend_row(&j, b, scores, row, qo);
        free(scores); free(row); free(qo);
    }
    return failed;
}
