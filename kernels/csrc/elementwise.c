/* The model's elementwise passes in float32, each one loop over rows: residual add + RMSNorm,
   SiLU(gate) * up, and rotary applied in place on the q/k block. Rows are split over torch's OpenMP
   threads from PARALLEL_MIN elements on; tinier ops run on the calling thread. Called from
   kernels/cpu_elementwise.py, which checks dtypes and strides first. */

#include <math.h>

/* Below this many elements one thread does the op: waking the pool costs more than it saves. */
#define PARALLEL_MIN 4096

/* out[t] = weight * normalize(x[t] (+ residual[t])); with add, residual[t] becomes x[t] + residual[t]. */
void add_rms_norm(const float *x, long x_stride, float *residual, long residual_stride,
                  const float *weight, float *out, long out_stride, int num_rows, int hidden,
                  float eps, int add, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * hidden >= PARALLEL_MIN)
    for (int t = 0; t < num_rows; t++) {
        const float *src = x + t * x_stride;
        if (add) {
            float *r = residual + t * residual_stride;
            for (int d = 0; d < hidden; d++) r[d] += src[d];
            src = r;
        }
        float sum_sq = 0.f;
        for (int d = 0; d < hidden; d++) sum_sq += src[d] * src[d];
        const float inv_rms = 1.f / sqrtf(sum_sq / hidden + eps);
        float *o = out + t * out_stride;
        for (int d = 0; d < hidden; d++) o[d] = weight[d] * (src[d] * inv_rms);
    }
}

/* out[t] = silu(gate_up[t, :inter]) * gate_up[t, inter:] */
void silu_mul(const float *gate_up, long in_stride, float *out, long out_stride, int num_rows, int inter,
              int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * inter >= PARALLEL_MIN)
    for (int t = 0; t < num_rows; t++) {
        const float *g = gate_up + t * in_stride, *u = g + inter;
        float *o = out + t * out_stride;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* In place, every head of token t: x * cos + swap_halves(x) * signed_sin (HF's rotate-half rotary;
   signed_sin has its first half negated). cos, signed_sin: (T, D) rows. */
void rotary(float *x, long token_stride, const float *cos, const float *signed_sin, long table_stride,
            int num_rows, int num_heads, int head_dim, int num_threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * num_heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < num_rows; t++) {
        const float *c = cos + t * table_stride, *s = signed_sin + t * table_stride;
        for (int h = 0; h < num_heads; h++) {
            float *v = x + t * token_stride + (long)h * head_dim;
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] + b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
