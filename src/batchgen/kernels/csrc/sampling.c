/* Greedy picks and log-normalizers of a step's logits in one pass per row: each row's max, its sum
   of exp(x - max) and the first index holding the max (torch's tie rule). Called from
   kernels/cpu_sampling.py, which checks dtypes and strides first. */

#include <math.h>

#define CHUNK 64
#define TOP_K_CHUNK 16  /* two AVX vectors: a chunk holds a value of a row's top 1024 of 49k ~28% of the time */
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

/* The top-k list of one row is a binary min-heap of (value, index) in which a lower value, or an equal
   value at a later index, ranks lower: its root is the entry the next larger value evicts. */
static inline int ranks_below(float a, long ia, float b, long ib) { return a < b || (a == b && ia > ib); }

static void sift_down(float *heap, long *heap_ids, int n, int i) {
    for (;;) {
        int low = i;
        const int left = 2 * i + 1, right = left + 1;
        if (left < n && ranks_below(heap[left], heap_ids[left], heap[low], heap_ids[low])) low = left;
        if (right < n && ranks_below(heap[right], heap_ids[right], heap[low], heap_ids[low])) low = right;
        if (low == i) return;
        const float v = heap[i]; heap[i] = heap[low]; heap[low] = v;
        const long id = heap_ids[i]; heap_ids[i] = heap_ids[low]; heap_ids[low] = id;
        i = low;
    }
}

static void sift_up(float *heap, long *heap_ids, int i) {
    while (i > 0) {
        const int parent = (i - 1) / 2;
        if (!ranks_below(heap[i], heap_ids[i], heap[parent], heap_ids[parent])) return;
        const float v = heap[i]; heap[i] = heap[parent]; heap[parent] = v;
        const long id = heap_ids[i]; heap_ids[i] = heap_ids[parent]; heap_ids[parent] = id;
        i = parent;
    }
}

/* Each row's k largest values in descending order with their indices (an equal value keeps the
   earlier index first, as a stable descending sort), into values[r * k ...] and ids[r * k ...];
   k <= vocab. Once the heap holds k entries, a 16-value chunk whose maximum does not beat its root
   is skipped after one vectorizable max, so most of the row costs one pass (values that beat the
   root: about k ln(vocab / k) of a row's); the heap is sorted at the end. log_z[r] (skipped when NULL) = log sum exp(x * inv_temperature[r]) over the row. */
void top_k_log_z(const float *x, long row_stride, int num_rows, int vocab, int k, float *values, long *ids,
                 const float *inv_temperature, float *log_z, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * vocab >= PARALLEL_MIN)
    for (int r = 0; r < num_rows; r++) {
        const float *row = x + r * row_stride;
        float *heap = values + (long)r * k;
        long *heap_ids = ids + (long)r * k;
        int filled = 0;
        for (int c = 0; c < vocab; c += TOP_K_CHUNK) {
            const int end = c + TOP_K_CHUNK < vocab ? c + TOP_K_CHUNK : vocab;
            int v = c;
            for (; v < end && filled < k; v++) {  /* the first k values fill the heap */
                heap[filled] = row[v];
                heap_ids[filled] = v;
                sift_up(heap, heap_ids, filled++);
            }
            if (v == end) continue;
            float chunk_max = -INFINITY;
            for (int u = v; u < end; u++) chunk_max = row[u] > chunk_max ? row[u] : chunk_max;
            if (!(chunk_max > heap[0])) continue;  /* equal values come later: they rank below the root */
            for (; v < end; v++) {
                if (row[v] > heap[0]) {
                    heap[0] = row[v];
                    heap_ids[0] = v;
                    sift_down(heap, heap_ids, k, 0);
                }
            }
        }
        /* Heap sort: pop the lowest-ranked entry to the end, so the array ends in descending order. */
        for (int n = k - 1; n > 0; n--) {
            const float v = heap[0]; heap[0] = heap[n]; heap[n] = v;
            const long id = heap_ids[0]; heap_ids[0] = heap_ids[n]; heap_ids[n] = id;
            sift_down(heap, heap_ids, n, 0);
        }
        if (log_z) {
            const float t = inv_temperature[r], m = heap[0] * t;
            float sum = 0.f;
            for (int v = 0; v < vocab; v++) sum += expf(row[v] * t - m);
            log_z[r] = m + logf(sum);
        }
    }
}
