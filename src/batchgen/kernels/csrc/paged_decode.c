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
   end. Head sizes of 2, 4, 8 or 16 machine vectors (64 and 128 on AVX-512 and AVX2) run a
   register-held form of the same loops, block by block: each query head's q and its outputs stay in
   registers over the block's tokens, four keys' dot products share one shuffle-and-add tree, and a
   bfloat16 cache is widened in registers; other head sizes run the general loops. On BF16 units
   (AVX-512 BF16), bfloat16 queries over a bfloat16 cache with head_dim 64 or 128 run vdpbf16ps for
   both products and round the probabilities to bfloat16 before P V (see DEFINE_ATTEND_ROW_DPBF16).
   Called from kernels/cpu_paged_attention.py, which checks every argument first. */

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "bf16.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>  /* the BF16-unit decode form */
#endif

/* One machine vector of floats (GCC vector extension): a zmm (16) with AVX-512, a ymm (8) otherwise;
   the register's own width (a wider one would live on the stack, see paged_prefill.c). */
#ifdef __AVX512F__
#define VEC_FLOATS 16
#else
#define VEC_FLOATS 8
#endif
typedef float vecf __attribute__((vector_size(VEC_FLOATS * sizeof(float))));
typedef int veci __attribute__((vector_size(VEC_FLOATS * sizeof(int))));
static inline vecf loadv(const float *p) { vecf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vecf v) { __builtin_memcpy(p, &v, sizeof v); }
typedef uint16_t vech __attribute__((vector_size(VEC_FLOATS * sizeof(uint16_t))));
typedef uint32_t vecw __attribute__((vector_size(VEC_FLOATS * sizeof(uint32_t))));
/* VEC_FLOATS bfloat16 values widened in registers (zero-extend, shift by 16): exact, no copy. */
static inline vecf loadv_bf16(const bf16_t *p) {
    vech h;
    __builtin_memcpy(&h, p, sizeof h);
    const vecw w = __builtin_convertvector(h, vecw) << 16;
    vecf f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}

/* out[0..3] = the lane sums of a, b, c, d: one shuffle-and-add tree for four dot products instead of
   four reductions (a vector's lanes summed alone cost as much as the dot product's FMAs at D = 64). */
static inline void sum4(vecf a, vecf b, vecf c, vecf d, float scale, float *out) {
#if VEC_FLOATS == 16
    const veci lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const veci hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const veci lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const veci hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const veci swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const veci swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    const vecf ab = __builtin_shuffle(a, b, lo1) + __builtin_shuffle(a, b, hi1);  /* a: 8 partials, b: 8 */
    const vecf cd = __builtin_shuffle(c, d, lo1) + __builtin_shuffle(c, d, hi1);
    vecf x = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2);  /* 4 partials each */
    x += __builtin_shuffle(x, swap2);
    x += __builtin_shuffle(x, swap1);  /* lanes 0, 4, 8, 12: the sums */
    out[0] = x[0] * scale; out[1] = x[4] * scale; out[2] = x[8] * scale; out[3] = x[12] * scale;
#else
    const veci lo1 = {0, 1, 2, 3, 8, 9, 10, 11}, hi1 = {4, 5, 6, 7, 12, 13, 14, 15};
    const veci lo2 = {0, 1, 4, 5, 8, 9, 12, 13}, hi2 = {2, 3, 6, 7, 10, 11, 14, 15};
    const veci swap1 = {1, 0, 3, 2, 5, 4, 7, 6};
    const vecf ab = __builtin_shuffle(a, b, lo1) + __builtin_shuffle(a, b, hi1);  /* a: 4 partials, b: 4 */
    const vecf cd = __builtin_shuffle(c, d, lo1) + __builtin_shuffle(c, d, hi1);
    vecf x = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2);  /* 2 partials each */
    x += __builtin_shuffle(x, swap1);  /* lanes 0, 2, 4, 6: the sums */
    out[0] = x[0] * scale; out[1] = x[2] * scale; out[2] = x[4] * scale; out[3] = x[6] * scale;
#endif
}

static inline float sum1(vecf a) {
    float s = 0.f;
    for (int l = 0; l < VEC_FLOATS; l++) s += a[l];
    return s;
}

typedef struct {
    const void *q;  /* float32, or bfloat16 with io_bf16 (out likewise) */
    const void *k_cache, *v_cache;  /* float32, bfloat16 (cache_bf16), or FP8 bytes when the tables below are set */
    const float *k_lut, *v_lut;  /* (256,) byte -> value * scale, or NULL */
    const int *lengths, *block_tables;
    void *out;
    int num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
    int cache_bf16, io_bf16;
    int window;  /* > 0: a row sees only its last `window` keys (sliding-window attention) */
    float softcap;  /* > 0: scores become softcap * tanh(score / softcap) before the softmax */
    const float *sinks;  /* (Hkv * G,) a logit per query head in the softmax's denominator only, or NULL */
} job_t;

/* The first key row b's query sees: L - window with a window shorter than the row, else 0. Blocks
   wholly before it are never read; the keys before it in its block weigh 0 (softmax_rows). */
static inline int first_key(const job_t *j, int L) {
    return j->window > 0 && L > j->window ? L - j->window : 0;
}

/* Block `i` of a row's table, as a pointer to its first token's (Hkv, D) record, or 0 past the row.
   `elem`: bytes per cached value (4 float32, 2 bfloat16, 1 FP8). */
static const char *block_at(const void *cache, const int *table, int i, int length, int block_size,
                            long token_stride, int elem) {
    return i * block_size < length ? (const char *)cache + (long)table[i] * block_size * token_stride * elem : 0;
}

/* How many of a row's L tokens block i holds (the last one may be partly filled). */
static inline int block_len(int i, int L, int block_size) {
    return L - i * block_size < block_size ? L - i * block_size : block_size;
}

/* Ask for the next block while this one is read: a row's blocks are scattered through the cache
   (decode blocks are allocated one at a time), so the hardware prefetcher loses the stream at every
   block. Into L2 (hint 1), which measured faster than L1 (docs/benchmarks/history/cpu-throughput.md). One per
   64 bytes. */
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

/* Row b's queries and outputs as float32 (HGD = heads x head_dim values): in place, or for bfloat16
   ones widened into qo and accumulated in qo + HGD, rounded into `out` at the end. */
static void row_queries(const job_t *j, int b, long HGD, float *qo, const float **q, float **out) {
    if (j->io_bf16) {
        widen_bf16((const bf16_t *)j->q + b * HGD, qo, HGD);
        *q = qo;
        *out = qo + HGD;
    } else {
        *q = (const float *)j->q + b * HGD;
        *out = (float *)j->out + b * HGD;
    }
}

/* Each of the HG score rows (L keys) to its exact softmax over the row's own keys (soft-capped, and
   only those in its window when the job has them; with sinks, query head hg's sink logit joins the
   denominator and weighs no value: gpt-oss), and the HG x D outputs zeroed for the P V sums. */
static void softmax_rows(const job_t *j, float *scores, int HG, int L, float *out, int D) {
    const int k0 = first_key(j, L);
    const float cap = j->softcap;
    for (int hg = 0; hg < HG; hg++) {
        float *sh = scores + (long)hg * L, m = -FLT_MAX, sum = 0.f;
        for (int l = 0; l < k0; l++) sh[l] = 0.f;  /* outside the window: weigh nothing */
        if (cap > 0.f) for (int l = k0; l < L; l++) sh[l] = cap * tanhf(sh[l] / cap);
        for (int l = k0; l < L; l++) m = sh[l] > m ? sh[l] : m;
        if (j->sinks && j->sinks[hg] > m) m = j->sinks[hg];
        for (int l = k0; l < L; l++) { sh[l] = expf(sh[l] - m); sum += sh[l]; }
        if (j->sinks) sum += expf(j->sinks[hg] - m);
        const float inv = 1.f / sum;
        for (int l = k0; l < L; l++) sh[l] *= inv;
        for (int d = 0; d < D; d++) out[(long)hg * D + d] = 0.f;
    }
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
    row_queries(j, b, (long)HG * D, qo, &q, &out);
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {
        const char *block = block_at(j->k_cache, table, i, L, BS, token_stride, k_elem);
        const char *next = block_at(j->k_cache, table, i + 1, L, BS, token_stride, k_elem);
        const int n = block_len(i, L, BS);
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
    softmax_rows(j, scores, HG, L, out, D);
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {
        const char *block = block_at(j->v_cache, table, i, L, BS, token_stride, v_elem);
        const char *next = block_at(j->v_cache, table, i + 1, L, BS, token_stride, v_elem);
        const int n = block_len(i, L, BS);
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

/* A block's n token records as floats: in place for a float32 cache, else widened into `buf`
   (n x token_stride floats) once for all the row's query heads. */
static const float *block_records(const char *block, int n, long token_stride, const float *lut, int is_bf16,
                                  float *buf) {
    if (!lut && !is_bf16) return (const float *)block;
    for (int t = 0; t < n; t++) token_record(block, t, token_stride, lut, is_bf16, buf + t * token_stride);
    return buf;
}

/* attend_row for head_dim = NV_ vectors: the same result with each query head's q and its output
   accumulators held in NV_ registers over a block's tokens (hg outer, tokens inner; the block's
   records stay in L1 across the group), and four keys' scores summed by one shuffle tree. BF16_: a
   bfloat16 cache read in place, each vector widened in registers (FP8 records are widened into
   `buf` first, float32 ones read in place). */
#define LOADKV(BF16_, base, index) \
    ((BF16_) ? loadv_bf16((const bf16_t *)(base) + (index)) : loadv((const float *)(base) + (index)))
#define DEFINE_ATTEND_ROW_VEC(NAME, NV_, BF16_)                                                        \
static void NAME(const job_t *j, int b, float *scores, float *buf, float *qo) {                       \
    const int H = j->num_kv_heads, G = j->group, D = NV_ * VEC_FLOATS, BS = j->block_size;           \
    const int L = j->lengths[b], HG = H * G;                                                          \
    const long token_stride = (long)H * D;                                                            \
    const int *table = j->block_tables + (long)b * j->max_blocks;                                     \
    const int cache_elem = j->cache_bf16 ? 2 : 4;                                                     \
    const int k_elem = j->k_lut ? 1 : cache_elem, v_elem = j->v_lut ? 1 : cache_elem;                \
    const float *q;                                                                                    \
    float *out;                                                                                        \
    row_queries(j, b, (long)HG * D, qo, &q, &out);                                                     \
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {                                             \
        const char *block = block_at(j->k_cache, table, i, L, BS, token_stride, k_elem);             \
        const char *next = block_at(j->k_cache, table, i + 1, L, BS, token_stride, k_elem);          \
        const int n = block_len(i, L, BS);                                                            \
        const void *keys = BF16_ ? (const void *)block                                                 \
            : (const void *)block_records(block, n, token_stride, j->k_lut, 0, buf);                   \
        for (int hg = 0; hg < HG; hg++) {                                                             \
            const long kh = (hg / G) * D;  /* this head's offset in a token record */                 \
            float *sh = scores + (long)hg * L + i * BS;                                               \
            vecf qv[NV_];                                                                             \
            for (int c = 0; c < NV_; c++) qv[c] = loadv(q + (long)hg * D + c * VEC_FLOATS);          \
            int t = 0;                                                                                \
            for (; t + 4 <= n; t += 4) {                                                              \
                vecf acc[4];                                                                          \
                /* the next block, a token at a time as this one is read (the first head's pass) */   \
                if (hg == 0) for (int u = 0; u < 4; u++) prefetch_token(next, t + u, token_stride, k_elem); \
                for (int u = 0; u < 4; u++) {                                                         \
                    const long k = kh + (t + u) * token_stride;                                       \
                    acc[u] = qv[0] * LOADKV(BF16_, keys, k);                                          \
                    for (int c = 1; c < NV_; c++) acc[u] += qv[c] * LOADKV(BF16_, keys, k + c * VEC_FLOATS); \
                }                                                                                     \
                sum4(acc[0], acc[1], acc[2], acc[3], j->scale, sh + t);                              \
            }                                                                                         \
            for (; t < n; t++) {                                                                      \
                if (hg == 0) prefetch_token(next, t, token_stride, k_elem);                           \
                const long k = kh + t * token_stride;                                                 \
                vecf acc = qv[0] * LOADKV(BF16_, keys, k);                                            \
                for (int c = 1; c < NV_; c++) acc += qv[c] * LOADKV(BF16_, keys, k + c * VEC_FLOATS); \
                sh[t] = sum1(acc) * j->scale;                                                         \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    softmax_rows(j, scores, HG, L, out, D);                                                               \
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {                                             \
        const char *block = block_at(j->v_cache, table, i, L, BS, token_stride, v_elem);             \
        const char *next = block_at(j->v_cache, table, i + 1, L, BS, token_stride, v_elem);          \
        const int n = block_len(i, L, BS);                                                            \
        const void *values = BF16_ ? (const void *)block                                               \
            : (const void *)block_records(block, n, token_stride, j->v_lut, 0, buf);                   \
        for (int hg = 0; hg < HG; hg++) {                                                             \
            const long vh = (hg / G) * D;                                                             \
            const float *ph = scores + (long)hg * L + i * BS;                                         \
            float *oh = out + (long)hg * D;                                                           \
            vecf acc[NV_];                                                                            \
            for (int c = 0; c < NV_; c++) acc[c] = loadv(oh + c * VEC_FLOATS);                       \
            for (int t = 0; t < n; t++) {                                                             \
                if (hg == 0) prefetch_token(next, t, token_stride, v_elem);                           \
                const float p = ph[t];                                                                \
                for (int c = 0; c < NV_; c++) acc[c] += p * LOADKV(BF16_, values, vh + t * token_stride + c * VEC_FLOATS); \
            }                                                                                         \
            for (int c = 0; c < NV_; c++) storev(oh + c * VEC_FLOATS, acc[c]);                       \
        }                                                                                             \
    }                                                                                                 \
    if (j->io_bf16) narrow_bf16(out, (bf16_t *)j->out + (long)b * HG * D, (long)HG * D);            \
}

DEFINE_ATTEND_ROW_VEC(attend_row_vec2, 2, 0)
DEFINE_ATTEND_ROW_VEC(attend_row_vec4, 4, 0)
DEFINE_ATTEND_ROW_VEC(attend_row_vec8, 8, 0)
DEFINE_ATTEND_ROW_VEC(attend_row_vec16, 16, 0)
DEFINE_ATTEND_ROW_VEC(attend_row_vec2_bf16, 2, 1)
DEFINE_ATTEND_ROW_VEC(attend_row_vec4_bf16, 4, 1)
DEFINE_ATTEND_ROW_VEC(attend_row_vec8_bf16, 8, 1)
DEFINE_ATTEND_ROW_VEC(attend_row_vec16_bf16, 16, 1)

typedef void (*attend_row_fn)(const job_t *, int, float *, float *, float *);

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 queries over a bfloat16 cache on BF16 units (vdpbf16ps): two products per float32 lane,
   accumulated in float32, no widening at all. Q K: a query head's bf16 q (head_dim / 32 registers)
   against each key as stored, four keys' sums by one shuffle tree. P V: the softmax's probabilities
   rounded to bfloat16 (as FlashAttention rounds P before its P V product on GPUs), two tokens per
   instruction: the two tokens' value rows are interleaved by unpacklo/hi (in-lane, one cheap
   instruction each) and multiplied by the broadcast pair of their probabilities; the outputs come
   out in the unpacks' lane order and are put back in order once per head. `buf` holds the rounded
   probabilities: HG rows of L + 2 values (a zero after each row pairs with an odd last token). */
static inline __m512i load512(const void *p) { return _mm512_loadu_si512(p); }

static inline void probabilities_bf16(const float *scores, int HG, int L, bf16_t *p16) {
    for (int hg = 0; hg < HG; hg++) {
        narrow_bf16(scores + (long)hg * L, p16 + (long)hg * (L + 2), L);
        p16[(long)hg * (L + 2) + L] = 0;
        p16[(long)hg * (L + 2) + L + 1] = 0;
    }
}

#define DEFINE_ATTEND_ROW_DPBF16(NAME, NW_)  /* head_dim = NW_ x 32 bfloat16 values */                \
static void NAME(const job_t *j, int b, float *scores, float *buf, float *qo) {                       \
    const int H = j->num_kv_heads, G = j->group, D = NW_ * 32, BS = j->block_size;                   \
    const int L = j->lengths[b], HG = H * G;                                                          \
    const long token_stride = (long)H * D;  /* bf16 values per token record */                        \
    const int *table = j->block_tables + (long)b * j->max_blocks;                                     \
    const bf16_t *q = (const bf16_t *)j->q + (long)b * HG * D;                                        \
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {                                             \
        const bf16_t *keys = (const bf16_t *)block_at(j->k_cache, table, i, L, BS, token_stride, 2);  \
        const char *next = block_at(j->k_cache, table, i + 1, L, BS, token_stride, 2);                \
        const int n = block_len(i, L, BS);                                                            \
        for (int hg = 0; hg < HG; hg++) {                                                             \
            const bf16_t *kh = keys + (hg / G) * D;                                                   \
            float *sh = scores + (long)hg * L + i * BS;                                               \
            __m512bh qv[NW_];                                                                         \
            for (int c = 0; c < NW_; c++) qv[c] = (__m512bh)load512(q + (long)hg * D + c * 32);      \
            int t = 0;                                                                                \
            for (; t + 4 <= n; t += 4) {                                                              \
                __m512 acc[4];                                                                        \
                if (hg == 0) for (int u = 0; u < 4; u++) prefetch_token(next, t + u, token_stride, 2); \
                for (int u = 0; u < 4; u++) {                                                         \
                    acc[u] = _mm512_setzero_ps();                                                     \
                    for (int c = 0; c < NW_; c++)                                                     \
                        acc[u] = _mm512_dpbf16_ps(acc[u], qv[c], (__m512bh)load512(kh + (t + u) * token_stride + c * 32)); \
                }                                                                                     \
                sum4((vecf)acc[0], (vecf)acc[1], (vecf)acc[2], (vecf)acc[3], j->scale, sh + t);      \
            }                                                                                         \
            for (; t < n; t++) {                                                                      \
                if (hg == 0) prefetch_token(next, t, token_stride, 2);                                \
                __m512 acc = _mm512_setzero_ps();                                                     \
                for (int c = 0; c < NW_; c++)                                                         \
                    acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)load512(kh + t * token_stride + c * 32)); \
                sh[t] = _mm512_reduce_add_ps(acc) * j->scale;                                         \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    softmax_rows(j, scores, HG, L, qo, D);  /* zeroes qo: HG x D float32 accumulators, unpack order */   \
    bf16_t *p16 = (bf16_t *)buf;                                                                      \
    probabilities_bf16(scores, HG, L, p16);                                                           \
    for (int i = first_key(j, L) / BS; i * BS < L; i++) {                                             \
        const bf16_t *values = (const bf16_t *)block_at(j->v_cache, table, i, L, BS, token_stride, 2); \
        const char *next = block_at(j->v_cache, table, i + 1, L, BS, token_stride, 2);                \
        const int n = block_len(i, L, BS);                                                            \
        for (int hg = 0; hg < HG; hg++) {                                                             \
            const bf16_t *vh = values + (hg / G) * D;                                                 \
            const bf16_t *ph = p16 + (long)hg * (L + 2) + i * BS;                                     \
            float *oh = qo + (long)hg * D;                                                            \
            __m512 lo[NW_], hi[NW_];                                                                  \
            for (int c = 0; c < NW_; c++) {                                                           \
                lo[c] = _mm512_loadu_ps(oh + c * 32);                                                 \
                hi[c] = _mm512_loadu_ps(oh + c * 32 + 16);                                            \
            }                                                                                         \
            for (int t = 0; t < n; t += 2) {                                                          \
                if (hg == 0) { prefetch_token(next, t, token_stride, 2); prefetch_token(next, t + 1, token_stride, 2); } \
                int pair;                                                                             \
                __builtin_memcpy(&pair, ph + t, sizeof pair);  /* (p[t], p[t + 1]) */                 \
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);                                \
                const long odd = t + 1 < n ? token_stride : 0;  /* a last odd token pairs with itself x 0 */ \
                for (int c = 0; c < NW_; c++) {                                                       \
                    const __m512i v0 = load512(vh + t * token_stride + c * 32);                       \
                    const __m512i v1 = load512(vh + t * token_stride + odd + c * 32);                 \
                    lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(v0, v1), pp);     \
                    hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(v0, v1), pp);     \
                }                                                                                     \
            }                                                                                         \
            for (int c = 0; c < NW_; c++) {                                                           \
                _mm512_storeu_ps(oh + c * 32, lo[c]);                                                 \
                _mm512_storeu_ps(oh + c * 32 + 16, hi[c]);                                            \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    /* unpack order -> head_dim order: in each 128-bit lane k, lo holds values 8k..8k+3 and hi        \
       8k+4..8k+7 of its 32 */                                                                        \
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);  \
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31); \
    float *ordered = qo + (long)HG * D;                                                               \
    for (long c = 0; c < (long)HG * NW_; c++) {                                                       \
        const __m512 lo = _mm512_loadu_ps(qo + c * 32), hi = _mm512_loadu_ps(qo + c * 32 + 16);       \
        _mm512_storeu_ps(ordered + c * 32, _mm512_permutex2var_ps(lo, first, hi));                    \
        _mm512_storeu_ps(ordered + c * 32 + 16, _mm512_permutex2var_ps(lo, second, hi));              \
    }                                                                                                 \
    narrow_bf16(ordered, (bf16_t *)j->out + (long)b * HG * D, (long)HG * D);                          \
}

DEFINE_ATTEND_ROW_DPBF16(attend_row_dpbf16_2, 2)
DEFINE_ATTEND_ROW_DPBF16(attend_row_dpbf16_4, 4)

/* The BF16-unit form for bf16 queries over a bf16 cache with head_dim 64 or 128 and an even block
   size (token pairs never straddle blocks); NULL: the float32-accumulating forms below. */
static attend_row_fn dpbf16_row_for(int head_dim, int block_size) {
    if (block_size % 2) return 0;
    return head_dim == 64 ? attend_row_dpbf16_2 : head_dim == 128 ? attend_row_dpbf16_4 : 0;
}
#define HAS_DPBF16 1
#else
#define HAS_DPBF16 0
#endif

/* The register-held form for head_dim of 2, 4, 8 or 16 vectors (a bfloat16 cache read in place when
   `is_bf16`); NULL: the general loops. */
static attend_row_fn vector_row_for(int head_dim, int is_bf16) {
    if (head_dim % VEC_FLOATS) return 0;
    switch (head_dim / VEC_FLOATS) {
        case 2: return is_bf16 ? attend_row_vec2_bf16 : attend_row_vec2;
        case 4: return is_bf16 ? attend_row_vec4_bf16 : attend_row_vec4;
        case 8: return is_bf16 ? attend_row_vec8_bf16 : attend_row_vec8;
        case 16: return is_bf16 ? attend_row_vec16_bf16 : attend_row_vec16;
        default: return 0;
    }
}

/* 1 when bfloat16 queries over a bfloat16 cache of this head_dim and block_size run on BF16 units,
   with the probabilities rounded to bfloat16 before P V (the tests' reference does the same). */
int paged_decode_rounds_probabilities(int head_dim, int block_size) {
#if HAS_DPBF16
    return dpbf16_row_for(head_dim, block_size) != 0;
#else
    (void)head_dim; (void)block_size;
    return 0;
#endif
}

/* Returns 0 on success. q, out: (rows, Hkv, group, D) contiguous, float32 or (io_bf16) bfloat16;
   k_cache, v_cache: (slots, Hkv, D) contiguous, slot = block * block_size + offset, float32,
   bfloat16 (cache_bf16) or (with k_lut, v_lut) FP8 bytes; block_tables: (rows, max_blocks);
   window > 0: sliding-window attention over a row's last `window` keys; softcap > 0: tanh capping;
   sinks: NULL, or (Hkv * group,) float32 sink logits (after any capping; see softmax_rows). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const float *k_lut, const float *v_lut, const int *lengths, const int *block_tables, void *out,
                           int num_rows, int num_kv_heads, int group, int head_dim,
                           int block_size, int max_blocks, float scale, int cache_bf16, int io_bf16,
                           int window, float softcap, const float *sinks, int num_threads) {
    int max_len = 1;
    for (int b = 0; b < num_rows; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    const job_t j = {q, k_cache, v_cache, k_lut, v_lut, lengths, block_tables, out, num_kv_heads, group, head_dim,
                     block_size, max_blocks, scale, cache_bf16, io_bf16, window, softcap, sinks};
    const size_t qo_floats = io_bf16 ? 2 * (size_t)num_kv_heads * group * head_dim : 1;
    /* a bfloat16 cache has no tables: its K and V both read in place */
    attend_row_fn vector_row = vector_row_for(head_dim, cache_bf16 && !k_lut && !v_lut);
    /* a widened token record, or (vector form) a widened block of them */
    size_t row_floats = (size_t)num_kv_heads * head_dim * (vector_row ? block_size : 1);
#if HAS_DPBF16
    const attend_row_fn dpbf16_row = io_bf16 && cache_bf16 && !k_lut && !v_lut ? dpbf16_row_for(head_dim, block_size) : 0;
    if (dpbf16_row) {
        vector_row = dpbf16_row;
        const size_t p16_floats = (size_t)num_kv_heads * group * (max_len + 2) / 2 + 1;  /* bf16 probabilities */
        row_floats = p16_floats > row_floats ? p16_floats : row_floats;
    }
#endif
    int failed = 0;
    /* OpenMP from torch's own libgomp (same soname, already loaded): torch's worker threads, which
       are still spinning after the previous op, take the rows; no second thread pool competes.
       Rows differ in length: dynamic scheduling keeps both threads busy to the end. */
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_kv_heads * group * (size_t)max_len);
        float *row = (float *)malloc(sizeof(float) * row_floats);
        float *qo = (float *)malloc(sizeof(float) * qo_floats);  /* widened queries, float32 outputs */
        if (!scores || !row || !qo) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < num_rows; b++)
            if (scores && row && qo) {
                if (vector_row) vector_row(&j, b, scores, row, qo);
                else attend_row(&j, b, scores, row, qo);
            }
        free(scores); free(row); free(qo);
    }
    return failed;
}
