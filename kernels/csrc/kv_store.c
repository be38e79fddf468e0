/* Cache writes: a step's new keys and values into their slots of the paged KV cache, both in one
   pass. Called from kernels/cpu_kv_store.py, which checks every slot first. */

/* k, v: (T, Hkv * D) rows with token strides (views into a fused qkv output); slot_mapping: (T,). */
void store_kv(const float *k, long k_token_stride, const float *v, long v_token_stride, float *k_cache,
              float *v_cache, const long *slot_mapping, int num_tokens, int row_size, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_tokens * row_size >= 4096)
    for (int t = 0; t < num_tokens; t++) {
        const long slot = slot_mapping[t];
        __builtin_memcpy(k_cache + slot * row_size, k + t * k_token_stride, sizeof(float) * row_size);
        __builtin_memcpy(v_cache + slot * row_size, v + t * v_token_stride, sizeof(float) * row_size);
    }
}
