/* The elementwise tail of a Llama layer in single passes over fp32 rows, split over OpenMP threads:
 *   add_rms_norm: residual += delta (optional), out = residual * rsqrt(mean(residual^2) + eps) * weight
 *   silu_mul:     out[:, i] = silu(gate_up[:, i]) * gate_up[:, I + i]
 *   rope:         rotate-half RoPE in place on the first `heads` heads of each row (q then k of a fused QKV row)
 * Torch spends 4-6 passes (and temporaries) on each; here each element is read and written once.
 * Accumulation in fp32 as the torch code does; exp through vec_math.h, which vectorizes.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

void pagedserve_add_rms_norm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                             int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        float* x = residual + r * dim;
        float* o = out + r * dim;
        float sum = 0.0f;
        if (delta) {
            const float* d = delta + r * dim;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) {
                x[i] += d[i];
                sum += x[i] * x[i];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (x[i] * inv);
    }
}

void pagedserve_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + vec_exp(-g[i])) * u[i];
    }
}

void pagedserve_rope(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                     const float* cos_table, const float* sin_table, const int64_t* positions) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos_table + positions[r] * half;
        const float* s = sin_table + positions[r] * half;
        for (int h = 0; h < heads; h++) {
            float* x1 = x + r * row_stride + (int64_t)h * head_dim;
            float* x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
