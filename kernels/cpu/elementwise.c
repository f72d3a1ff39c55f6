/* The elementwise tail of a Llama layer in single passes over fp32 rows, split over OpenMP threads:
 *   add_rms_norm: residual += delta (optional), out = residual * rsqrt(mean(residual^2) + eps) * weight
 *   silu_mul:     out[:, i] = silu(gate_up[:, i]) * gate_up[:, I + i]
 *   rope:         rotate-half RoPE in place on the first `heads` heads of each row (q then k of a fused QKV row)
 * Torch spends 4-6 passes (and temporaries) on each; here each element is read and written once.
 * Accumulation in fp32 as the torch code does; exp through vec_math.h, which vectorizes.
 */
#include <math.h>
#include <stdint.h>

#include "rows.h"

void pagedserve_add_rms_norm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                             int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(residual + r * dim, delta ? delta + r * dim : 0, weight, out + r * dim, dim, eps);
}

void pagedserve_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, 0, inter);
}

void pagedserve_rope(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                     const float* cos_table, const float* sin_table, const int64_t* positions) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope_head(x + r * row_stride + (int64_t)h * head_dim, cos_table + positions[r] * half,
                      sin_table + positions[r] * half, half);
}
