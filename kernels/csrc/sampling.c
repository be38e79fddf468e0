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
