/* The model's elementwise passes, each one loop over rows: residual add + RMSNorm, SiLU(gate) * up,
   and rotary applied in place on the q/k block; in float32, and in bfloat16 (the *_bf16 functions:
   each row widened into float32, computed there, rounded to nearest even where the eager bfloat16
   ops round, so they give what those give). Rows are split over torch's OpenMP threads from
   PARALLEL_MIN elements on; tinier ops run on the calling thread. Called from
   kernels/cpu_elementwise.py, which checks dtypes and strides first. */

#include <math.h>
#include <stdlib.h>

#include "bf16.h"

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

/* bfloat16 rounding of a float32 value, kept as float32 */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* add_rms_norm in bfloat16: x + residual rounded to bfloat16 (and stored back with add), the norm in
   float32, then weight * round(normalized), rounded: the eager bfloat16 ops' roundings. Returns 0,
   or 1 when a row buffer could not be allocated. */
int add_rms_norm_bf16(const bf16_t *x, long x_stride, bf16_t *residual, long residual_stride,
                      const bf16_t *weight, bf16_t *out, long out_stride, int num_rows, int hidden,
                      float eps, int add, int num_threads) {
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if ((long)num_rows * hidden >= PARALLEL_MIN) reduction(|:failed)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)hidden);
        if (!row) failed = 1;
        #pragma omp for schedule(static)
        for (int t = 0; t < num_rows; t++) {
            if (!row) continue;
            widen_bf16(x + t * x_stride, row, hidden);
            if (add) {
                bf16_t *r = residual + t * residual_stride;
                for (int d = 0; d < hidden; d++) row[d] = round_bf16(row[d] + bf16_to_f32(r[d]));
                narrow_bf16(row, r, hidden);  /* exact: already rounded */
            }
            float sum_sq = 0.f;
            for (int d = 0; d < hidden; d++) sum_sq += row[d] * row[d];
            const float inv_rms = 1.f / sqrtf(sum_sq / hidden + eps);
            bf16_t *o = out + t * out_stride;
            for (int d = 0; d < hidden; d++) o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * round_bf16(row[d] * inv_rms));
        }
        free(row);
    }
    return failed;
}

/* silu_mul in bfloat16: silu(gate) computed in float32 and rounded, times up, rounded. */
void silu_mul_bf16(const bf16_t *gate_up, long in_stride, bf16_t *out, long out_stride, int num_rows, int inter,
                   int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * inter >= PARALLEL_MIN)
    for (int t = 0; t < num_rows; t++) {
        const bf16_t *g = gate_up + t * in_stride, *u = g + inter;
        bf16_t *o = out + t * out_stride;
        for (int i = 0; i < inter; i++) {
            const float gi = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gi / (1.f + expf(-gi))) * bf16_to_f32(u[i]));
        }
    }
}

/* rotary in bfloat16, in place, tables in bfloat16: x * cos + swap_halves(x) * signed_sin in float32,
   rounded once (the eager ops round each product too; the difference is within one bfloat16 step). */
void rotary_bf16(bf16_t *x, long token_stride, const bf16_t *cos, const bf16_t *signed_sin, long table_stride,
                 int num_rows, int num_heads, int head_dim, int num_threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * num_heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < num_rows; t++) {
        const bf16_t *c = cos + t * table_stride, *s = signed_sin + t * table_stride;
        for (int h = 0; h < num_heads; h++) {
            bf16_t *v = x + t * token_stride + (long)h * head_dim;
            for (int d = 0; d < half; d++) {
                const float a = bf16_to_f32(v[d]), b = bf16_to_f32(v[d + half]);
                v[d] = f32_to_bf16(a * bf16_to_f32(c[d]) + b * bf16_to_f32(s[d]));
                v[d + half] = f32_to_bf16(b * bf16_to_f32(c[d + half]) + a * bf16_to_f32(s[d + half]));
            }
        }
    }
}
