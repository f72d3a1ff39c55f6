/* One row (or head) of the elementwise tail, shared by elementwise.c (its OpenMP loops over rows) and
 * decode_step.c (its stages inside one parallel region), so the two compute the same floats. */
#ifndef PAGEDSERVE_ROWS_H
#define PAGEDSERVE_ROWS_H
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

/* x += delta (when given); out = x * rsqrt(mean(x^2) + eps) * weight. */
static inline void add_rms_norm_row(float* x, const float* delta, const float* weight, float* out, int64_t dim,
                                    float eps) {
    float sum = 0.0f;
    if (delta) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) {
            x[i] += delta[i];
            sum += x[i] * x[i];
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    }
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inv);
}

/* out[i] = silu(gate[i]) * up[i] for i in [begin, end). */
static inline void silu_mul_span(const float* gate, const float* up, float* out, int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; i++) out[i] = gate[i] / (1.0f + vec_exp(-gate[i])) * up[i];
}

/* Rotate-half RoPE in place on one head: x1 = x[:half], x2 = x[half:]; c, s: the position's cos, sin. */
static inline void rope_head(float* x, const float* c, const float* s, int half) {
    float* x2 = x + half;
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x2[i];
        x[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
    }
}
#endif
