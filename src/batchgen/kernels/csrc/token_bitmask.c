/* A packed token bitmask applied to chosen rows of a step's logits in place: bit j of int32 word w of
   bitmask row i allows token 32w + j of logits row rows[i]; every other token becomes -inf. Called
   from kernels/cpu_token_bitmask.py, which checks dtypes, shapes and strides first. One thread: 64
   rows of 49152 take well under a millisecond, less than waking a parallel team costs on a busy CPU. */

#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, long row_stride, int vocab, const int32_t *bitmask, int num_words,
                         const int64_t *rows, int num_rows) {
    for (int i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *words = (const uint32_t *)(bitmask + (long)i * num_words);
        for (int w = 0; w < num_words; w++) {
            const uint32_t word = words[w];
            if (word == 0xFFFFFFFFu) continue;  /* every token of the word allowed: the common case in text */
            const int base = 32 * w;
            const int end = base + 32 < vocab ? base + 32 : vocab;
            if (word == 0) {  /* none allowed: the common case in a constrained position */
                for (int v = base; v < end; v++) row[v] = -INFINITY;
                continue;
            }
            for (int v = base; v < end; v++)
                if (!((word >> (v - base)) & 1u)) row[v] = -INFINITY;
        }
    }
}
