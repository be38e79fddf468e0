/* Prefill attention in float32 on the paged KV cache: query chunks attend their cached context and
   themselves causally (fresh prompts and chunks that continue a cached prefix alike).

   Each (chunk, KV head) gathers its keys [0, context + queries) out of their blocks once (K
   transposed, V in rows), then computes scores in 6 x 16 register tiles, an exact softmax per row
   over the keys it may see, and P V in 6 x 64 tiles: no padding, no mask tensor. Work items are
   split over torch's OpenMP threads. FP8 caches (k_lut/v_lut not NULL) are widened through the
   layer's 256-entry table (byte -> value * scale) in that gather, bfloat16 caches (cache_bf16) by a
   16-bit shift. bfloat16 queries and outputs (io_bf16): each tile's query rows are widened once
   into float32, its outputs computed in float32 and rounded to nearest even as they are written.
   Called from kernels/cpu_paged_attention.py, which checks every argument first. */

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "bf16.h"

#define QK_ROWS 6     /* query rows per register tile of scores (6 x 16 keys) */
#define PV_ROWS 6     /* query rows per register tile of outputs */
#define LANES 16      /* keys per score tile (the padding unit), head dims per narrow output tile */
#define ROW_TILE 96   /* query rows whose scores are kept at once */

/* One machine vector of floats (GCC/Clang vector extension): a zmm (16) with AVX-512, a ymm (8)
   otherwise. The width must be the register's: a 64-byte vector on AVX2 is not two ymm registers but
   a value GCC keeps on the stack, every FMA going through memory. A tile is
   rows x VECS vectors of accumulators, sized to the register file: AVX-512's 32 zmm hold 6 x 4 (a
   64-dim head of outputs), AVX2's 16 ymm hold 6 x 2. Written out because the auto-vectorizer left
   these tiles scalar. */
#ifdef __AVX512F__
#define VEC_FLOATS 16
#define PV_WIDE_VECS 4
#else
#define VEC_FLOATS 8
#define PV_WIDE_VECS 2
#endif
#define KEY_VECS (LANES / VEC_FLOATS)  /* vectors per 16-key score tile */
#define PV_NARROW_VECS (LANES / VEC_FLOATS)  /* vectors per 16-dim output tile */
typedef float vecf __attribute__((vector_size(VEC_FLOATS * sizeof(float))));
static inline vecf loadv(const float *p) { vecf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vecf v) { __builtin_memcpy(p, &v, sizeof v); }

typedef struct {
    const void *q;  /* float32, or bfloat16 with io_bf16 (out likewise) */
    const void *k_cache, *v_cache;  /* float32, bfloat16 (cache_bf16), or FP8 bytes when the tables below are set */
    const float *k_lut, *v_lut;  /* (256,) byte -> value * scale, or NULL */
    void *out;
    long q_token_stride, out_token_stride;  /* in elements */
    const int *token_starts, *query_lens, *context_lens, *block_tables;
    int max_blocks, num_kv_heads, group, head_dim, block_size;
    float scale;
    int cache_bf16, io_bf16;
    int window;  /* > 0: a query sees only the last `window` positions, itself included */
    float softcap;  /* > 0: scores become softcap * tanh(score / softcap) before the softmax */
    const float *sinks;  /* (Hkv * group,) a logit per query head in the softmax's denominator only, or NULL */
} prefill_job_t;

/* The first key query row r (token r / G, at position ctx + r / G) sees. */
static inline int row_first_key(const prefill_job_t *j, int ctx, int r) {
    const int last = ctx + r / j->group;
    return j->window > 0 && last >= j->window ? last - j->window + 1 : 0;
}

/* Where a tile of rows starting at r0 begins reading keys: its first row's first key, down to a
   16-key score tile (rows sharing a tile read from the same key; what precedes a row's own first
   key weighs 0). */
static inline int tile_first_key(const prefill_job_t *j, int ctx, int r0) {
    return row_first_key(j, ctx, r0) / LANES * LANES;
}

/* out rows [r0, r0 + nr) = P V over their keys, NV_ vectors of head dims at a time held in registers.
   One copy per width: PV_WIDE_VECS (a whole 64-dim head with AVX-512, 16 dims with AVX2) and 16 dims
   (any head_dim that is a multiple of 16; more P reads). `obuf`: with
   bfloat16 outputs, the tile's float32 rows (row r at (r - tile) * D), else NULL (written in place). */
#define DEFINE_PV_TILE(NAME, NV_)                                                                    \
static void NAME(const prefill_job_t *j, const float *scores, const float *vb, float *out, float *obuf, \
                 int ctx, int tile, int padded, int r0, int nr) {                                    \
    const int G = j->group, D = j->head_dim;                                                         \
    const int row_keys = ctx + (r0 + nr - 1) / G + 1;                                                \
    const float *pr[PV_ROWS];                                                                        \
    for (int t = 0; t < PV_ROWS; t++) pr[t] = scores + (long)(r0 - tile + (t < nr ? t : 0)) * padded; \
    for (int d0 = 0; d0 < D; d0 += NV_ * VEC_FLOATS) {                                               \
        vecf acc[PV_ROWS][NV_];                                                                      \
        for (int t = 0; t < PV_ROWS; t++) for (int c = 0; c < NV_; c++) acc[t][c] = (vecf){0};      \
        for (int key = tile_first_key(j, ctx, r0); key < row_keys; key++) {                         \
            vecf v[NV_];                                                                             \
            for (int c = 0; c < NV_; c++) v[c] = loadv(vb + (long)key * D + d0 + VEC_FLOATS * c);   \
            for (int t = 0; t < PV_ROWS; t++) {                                                      \
                const float p = pr[t][key];                                                          \
                for (int c = 0; c < NV_; c++) acc[t][c] += p * v[c];                                 \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nr; t++) {                                                               \
            const int r = r0 + t;                                                                    \
            float *o = (obuf ? obuf + (long)(r - tile) * D                                           \
                             : out + (r / G) * j->out_token_stride + (r % G) * D) + d0;              \
            for (int c = 0; c < NV_; c++) storev(o + VEC_FLOATS * c, acc[t][c]);                    \
        }                                                                                            \
    }                                                                                                \
}
DEFINE_PV_TILE(pv_tile_wide, PV_WIDE_VECS)
DEFINE_PV_TILE(pv_tile_16, PV_NARROW_VECS)

/* Query rows r = token * G + g of one (sequence, kv head), rows [row_begin, row_end): scores against
   keys [0, context + token] packed as K^T (D, padded keys), exact softmax, then P V. */
static void prefill_rows(const prefill_job_t *j, int seq, int h, int row_begin, int row_end,
                         float *kt, float *vb, float *scores, float *qo) {
    const int G = j->group, D = j->head_dim, BS = j->block_size;
    const int ctx = j->context_lens[seq];
    const int num_keys = ctx + (row_end - 1) / G + 1;  /* what the last row sees */
    const int padded = (num_keys + LANES - 1) / LANES * LANES;
    const long token_stride = (long)j->num_kv_heads * D;
    const int *table = j->block_tables + (long)seq * j->max_blocks;
    const int first_gathered = tile_first_key(j, ctx, row_begin);  /* keys before it: no row sees them */
    for (int key = first_gathered; key < num_keys; key++) {  /* gather K^T and V rows out of their blocks */
        const long offset = ((long)table[key / BS] * BS + key % BS) * token_stride + (long)h * D;
        if (j->k_lut) {
            const unsigned char *kr = (const unsigned char *)j->k_cache + offset;
            for (int d = 0; d < D; d++) kt[(long)d * padded + key] = j->k_lut[kr[d]];
        } else if (j->cache_bf16) {
            const bf16_t *kr = (const bf16_t *)j->k_cache + offset;
            for (int d = 0; d < D; d++) kt[(long)d * padded + key] = bf16_to_f32(kr[d]);
        } else {
            const float *kr = (const float *)j->k_cache + offset;
            for (int d = 0; d < D; d++) kt[(long)d * padded + key] = kr[d];
        }
        if (j->v_lut) {
            const unsigned char *vr = (const unsigned char *)j->v_cache + offset;
            for (int d = 0; d < D; d++) vb[(long)key * D + d] = j->v_lut[vr[d]];
        } else if (j->cache_bf16) {
            widen_bf16((const bf16_t *)j->v_cache + offset, vb + (long)key * D, D);
        } else {
            const float *vr = (const float *)j->v_cache + offset;
            for (int d = 0; d < D; d++) vb[(long)key * D + d] = vr[d];
        }
    }
    for (int d = 0; d < D; d++)
        for (int key = num_keys; key < padded; key++) kt[(long)d * padded + key] = 0.f;
    const long token0 = j->token_starts[seq];
    const long q_offset = token0 * j->q_token_stride + (long)h * G * D;
    const long out_offset = token0 * j->out_token_stride + (long)h * G * D;
    /* float32 q and out in place; bfloat16 ones through qo: the tile's widened queries, then its outputs */
    const float *q = j->io_bf16 ? 0 : (const float *)j->q + q_offset;
    float *out = j->io_bf16 ? 0 : (float *)j->out + out_offset;
    float *obuf = j->io_bf16 ? qo + (long)ROW_TILE * D : 0;
    for (int tile = row_begin; tile < row_end; tile += ROW_TILE) {
        const int tile_end = tile + ROW_TILE < row_end ? tile + ROW_TILE : row_end;
        if (j->io_bf16)
            for (int r = tile; r < tile_end; r++)
                widen_bf16((const bf16_t *)j->q + q_offset + (r / G) * j->q_token_stride + (r % G) * D,
                           qo + (long)(r - tile) * D, D);
        for (int r0 = tile; r0 < tile_end; r0 += QK_ROWS) {
            const int nr = tile_end - r0 < QK_ROWS ? tile_end - r0 : QK_ROWS;
            const float *qr[QK_ROWS];
            for (int t = 0; t < QK_ROWS; t++) {
                const int r = r0 + (t < nr ? t : 0);
                qr[t] = j->io_bf16 ? qo + (long)(r - tile) * D : q + (r / G) * j->q_token_stride + (r % G) * D;
            }
            const int row_keys = ctx + (r0 + nr - 1) / G + 1;
            for (int k0 = tile_first_key(j, ctx, r0); k0 < row_keys; k0 += LANES) {
                vecf acc[QK_ROWS][KEY_VECS];
                for (int t = 0; t < QK_ROWS; t++) for (int c = 0; c < KEY_VECS; c++) acc[t][c] = (vecf){0};
                for (int d = 0; d < D; d++) {
                    vecf kd[KEY_VECS];
                    for (int c = 0; c < KEY_VECS; c++) kd[c] = loadv(kt + (long)d * padded + k0 + VEC_FLOATS * c);
                    for (int t = 0; t < QK_ROWS; t++)
                        for (int c = 0; c < KEY_VECS; c++) acc[t][c] += qr[t][d] * kd[c];
                }
                for (int t = 0; t < nr; t++)
                    for (int c = 0; c < KEY_VECS; c++)
                        storev(scores + (long)(r0 - tile + t) * padded + k0 + VEC_FLOATS * c, acc[t][c] * j->scale);
            }
        }
        for (int r = tile; r < tile_end; r++) {  /* exact softmax over the row's own keys */
            float *sr = scores + (long)(r - tile) * padded, m = -FLT_MAX, sum = 0.f;
            const int n = ctx + r / G + 1, first = row_first_key(j, ctx, r);
            /* keys its score tile read before its window (its tile's first row's may start earlier) */
            for (int key = tile_first_key(j, ctx, tile + (r - tile) / QK_ROWS * QK_ROWS); key < first; key++)
                sr[key] = 0.f;
            if (j->softcap > 0.f)
                for (int key = first; key < n; key++) sr[key] = j->softcap * tanhf(sr[key] / j->softcap);
            for (int key = first; key < n; key++) m = sr[key] > m ? sr[key] : m;
            /* a sink (gpt-oss): query head h * G + r % G's logit joins the denominator, weighs no value */
            const float sink = j->sinks ? j->sinks[h * G + r % G] : 0.f;
            if (j->sinks && sink > m) m = sink;
            for (int key = first; key < n; key++) { sr[key] = expf(sr[key] - m); sum += sr[key]; }
            if (j->sinks) sum += expf(sink - m);
            const float inv = 1.f / sum;
            for (int key = first; key < n; key++) sr[key] *= inv;
            for (int key = n; key < padded; key++) sr[key] = 0.f;  /* masked keys weigh nothing */
        }
        for (int r0 = tile; r0 < tile_end; r0 += PV_ROWS) {
            const int nr = tile_end - r0 < PV_ROWS ? tile_end - r0 : PV_ROWS;
            if (D % (PV_WIDE_VECS * VEC_FLOATS) == 0) pv_tile_wide(j, scores, vb, out, obuf, ctx, tile, padded, r0, nr);
            else pv_tile_16(j, scores, vb, out, obuf, ctx, tile, padded, r0, nr);
        }
        if (j->io_bf16)
            for (int r = tile; r < tile_end; r++)
                narrow_bf16(obuf + (long)(r - tile) * D,
                            (bf16_t *)j->out + out_offset + (r / G) * j->out_token_stride + (r % G) * D, D);
    }
}

/* Returns 0 on success. q: (T, H, D) with token stride q_token_stride (contiguous heads); out likewise;
   both float32 or (io_bf16) bfloat16; caches as for decode (float32, bfloat16 with cache_bf16, or
   FP8 bytes with k_lut, v_lut); per prefill sequence: its first flat token, query and context
   lengths and block table (max_blocks). head_dim must be a multiple of 16. window > 0: each query sees
   only the last `window` positions (itself included); softcap > 0: tanh capping of the scores; sinks:
   NULL, or (Hkv * group,) float32 sink logits joining each row's denominator (after any capping). */
int paged_prefill_attention(const void *q, long q_token_stride, const void *k_cache, const void *v_cache,
                            const float *k_lut, const float *v_lut, void *out, long out_token_stride, const int *token_starts, const int *query_lens,
                            const int *context_lens, const int *block_tables, int num_seqs, int max_blocks,
                            int num_kv_heads, int group, int head_dim, int block_size, float scale,
                            int cache_bf16, int io_bf16, int window, float softcap, const float *sinks,
                            int num_threads) {
    int max_keys = 1;
    for (int i = 0; i < num_seqs; i++) {
        const int n = context_lens[i] + query_lens[i];
        max_keys = n > max_keys ? n : max_keys;
    }
    const int padded = (max_keys + LANES - 1) / LANES * LANES;
    /* Few long sequences: split each one's query rows so every thread has work. */
    const int num_pairs = num_seqs * num_kv_heads;
    const int num_splits = num_pairs >= 4 * num_threads ? 1 : (4 * num_threads + num_pairs - 1) / num_pairs;
    const prefill_job_t j = {q, k_cache, v_cache, k_lut, v_lut, out, q_token_stride, out_token_stride, token_starts,
                             query_lens, context_lens, block_tables, max_blocks, num_kv_heads, group, head_dim,
                             block_size, scale, cache_bf16, io_bf16, window, softcap, sinks};
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *kt = (float *)malloc(sizeof(float) * (size_t)head_dim * padded);
        float *vb = (float *)malloc(sizeof(float) * (size_t)head_dim * padded);
        float *scores = (float *)malloc(sizeof(float) * (size_t)ROW_TILE * padded);
        /* bfloat16 q/out: a tile's widened query rows, then its float32 output rows */
        float *qo = (float *)malloc(sizeof(float) * (io_bf16 ? 2 * (size_t)ROW_TILE * head_dim : 1));
        if (!kt || !vb || !scores || !qo) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_pairs * num_splits; item++) {
            if (!kt || !vb || !scores || !qo) continue;
            const int pair = item / num_splits, split = item % num_splits;
            const int seq = pair / num_kv_heads, h = pair % num_kv_heads;
            const int rows = query_lens[seq] * group;
            /* later rows see more keys: equal row counts are unequal work, but close enough here */
            const int per_split = (rows + num_splits - 1) / num_splits;
            const int begin = split * per_split, end = begin + per_split < rows ? begin + per_split : rows;
            if (begin < end) prefill_rows(&j, seq, h, begin, end, kt, vb, scores, qo);
        }
        free(kt); free(vb); free(scores); free(qo);
    }
    return failed;
}

