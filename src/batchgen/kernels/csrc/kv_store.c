/* Cache writes: a step's new keys and values into their slots of the paged KV cache, both in one
   pass. Called from kernels/cpu_kv_store.py, which checks every slot first (and, for an FP8 cache,
   hands over rows already quantized to one byte per value). */

#include "bf16.h"

/* k, v: (T, row_bytes) rows with token strides in bytes (views into a fused qkv output);
   slot_mapping: (T,); the caches hold row_bytes per slot. */
void store_kv(const char *k, long k_token_stride, const char *v, long v_token_stride, char *k_cache,
              char *v_cache, const long *slot_mapping, int num_tokens, int row_bytes, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_tokens * row_bytes >= 16384)
    for (int t = 0; t < num_tokens; t++) {
        const long slot = slot_mapping[t];
        __builtin_memcpy(k_cache + slot * row_bytes, k + t * k_token_stride, row_bytes);
        __builtin_memcpy(v_cache + slot * row_bytes, v + t * v_token_stride, row_bytes);
    }
}

/* float32 rows into a bfloat16 cache, rounded to nearest even: k, v: (T, row) floats with token
   strides in floats; the caches hold `row` bf16 values per slot. */
void store_kv_to_bf16(const float *k, long k_token_stride, const float *v, long v_token_stride, bf16_t *k_cache,
                      bf16_t *v_cache, const long *slot_mapping, int num_tokens, int row, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_tokens * row >= 8192)
    for (int t = 0; t < num_tokens; t++) {
        const long slot = slot_mapping[t];
        narrow_bf16(k + t * k_token_stride, k_cache + slot * row, row);
        narrow_bf16(v + t * v_token_stride, v_cache + slot * row, row);
    }
}
