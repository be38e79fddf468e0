/* Greedy picks and log-normalizers of a step's logits in one pass per row: each row's max, its sum
   of exp(x - max) and the first index holding the max (torch's tie rule). Called from
   kernels/cpu_sampling.py, which checks dtypes and strides first. */

#include <math.h>

#define CHUNK 64
#define PARALLEL_MIN 65536

/* argmax[r]: first index of row r's maximum; log_z[r] = log(sum(exp(x[r]))), skipped (the exp
   pass is most of the cost) when log_z is NULL. */
void argmax_log_z(const float *x, long row_stride, int num_rows, int vocab, long *argmax, float *log_z,
                  int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * vocab >= PARALLEL_MIN)
    for (int r = 0; r < num_rows; r++) {
        const float *row = x + r * row_stride;
        float m = -INFINITY;
        for (int v = 0; v < vocab; v++) m = row[v] > m ? row[v] : m;
        if (log_z) {
            float sum = 0.f;
            for (int v = 0; v < vocab; v++) sum += expf(row[v] - m);
            log_z[r] = m + logf(sum);
        }
        long first = 0;
        for (int c = 0; c < vocab; c += CHUNK) {  /* the first chunk holding the max, then its index */
            const int end = c + CHUNK < vocab ? c + CHUNK : vocab;
            float chunk_max = -INFINITY;
            for (int v = c; v < end; v++) chunk_max = row[v] > chunk_max ? row[v] : chunk_max;
            if (chunk_max == m) {
                int v = c;
                while (v < end - 1 && row[v] != m) v++;
                first = v;
                break;
            }
        }
        argmax[r] = first;
    }
}

/* Each row's k largest values in descending order with their indices (an equal value keeps the
   earlier index first, as a stable descending sort), into values[r * k ...] and ids[r * k ...];
   k <= vocab. A chunk of the row whose maximum does not beat the current k-th value is skipped
   after one vectorizable max, so past the first few chunks most of the row costs one pass.
   log_z[r] (skipped when NULL) = log sum exp(x * inv_temperature[r]) over the row. */
void top_k_log_z(const float *x, long row_stride, int num_rows, int vocab, int k, float *values, long *ids,
                 const float *inv_temperature, float *log_z, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * vocab >= PARALLEL_MIN)
    for (int r = 0; r < num_rows; r++) {
        const float *row = x + r * row_stride;
        float *top = values + (long)r * k;
        long *top_ids = ids + (long)r * k;
        int filled = 0;
        for (int c = 0; c < vocab; c += CHUNK) {
            const int end = c + CHUNK < vocab ? c + CHUNK : vocab;
            if (filled == k) {
                float chunk_max = -INFINITY;
                for (int v = c; v < end; v++) chunk_max = row[v] > chunk_max ? row[v] : chunk_max;
                if (!(chunk_max > top[k - 1])) continue;
            }
            for (int v = c; v < end; v++) {
                const float value = row[v];
                if (filled == k && !(value > top[k - 1])) continue;
                /* first slot holding a smaller value: equal values (earlier indices) stay ahead */
                int lo = 0, hi = filled;
                while (lo < hi) {
                    const int mid = (lo + hi) / 2;
                    if (top[mid] >= value) lo = mid + 1; else hi = mid;
                }
                const int last = filled < k ? filled : k - 1;  /* a full list drops its last entry */
                for (int i = last; i > lo; i--) {
                    top[i] = top[i - 1];
                    top_ids[i] = top_ids[i - 1];
                }
                top[lo] = value;
                top_ids[lo] = v;
                if (filled < k) filled++;
            }
        }
        if (log_z) {
            const float t = inv_temperature[r], m = top[0] * t;
            float sum = 0.f;
            for (int v = 0; v < vocab; v++) sum += expf(row[v] * t - m);
            log_z[r] = m + logf(sum);
        }
    }
}
