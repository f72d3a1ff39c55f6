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

/* GELU-tanh's sigmoid argument: gelu(g) = 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3). */
#define GELU_C1 1.5957691216057308f  /* 2 sqrt(2/pi) */
#define GELU_C3 0.0713548162726009f  /* 2 sqrt(2/pi) 0.044715 */

/* out[i] = act(gate[i]) * up[i] for i in [begin, end): act SiLU, g sigmoid(g), or with gelu GELU-tanh,
   g sigmoid(2u) (Gemma's GeGLU), the same lanes either way. */
static inline void act_mul_span(const float* gate, const float* up, float* out, int64_t begin, int64_t end,
                                int gelu) {
#if defined(__AVX512F__)
    /* 1 / (1 + e^-g) as a 14-bit reciprocal and one Newton step (within an ulp of the quotient): a vector
       division takes as long as the rest of the row; every lane alike, the last through a mask */
    for (int64_t i = begin; i < end; i += 16) {
        const __mmask16 k = end - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - i)) - 1u);
        const __m512 g = _mm512_maskz_loadu_ps(k, gate + i);
        const __m512 t = gelu ? _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(GELU_C3),
                                                                  _mm512_set1_ps(GELU_C1)))
                              : g;
        const __m512 e = exp512_nonpositive(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), t),
                                                          _mm512_set1_ps(88.0f)));
        const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(_mm512_mul_ps(g, r), _mm512_maskz_loadu_ps(k, up + i)));
    }
#else
#if defined(__AVX2__) && defined(__FMA__)
    /* eight lanes at a time, the quotient exact, a tail through the same lanes (so a value does not depend on
       where a thread's span began); the -std=c11 build never vectorized vec_exp's loop: a prompt's SiLU had
       cost 3.5% of its step */
    for (int64_t i = begin; i < end; i += 8) {
        const int n = end - i < 8 ? (int)(end - i) : 8;
        float g8[8] = {0}, u8[8] = {0}, o8[8];
        const float *gp = gate + i, *up8 = up + i;
        if (n < 8) {
            for (int j = 0; j < n; j++) g8[j] = gate[i + j], u8[j] = up[i + j];
            gp = g8;
            up8 = u8;
        }
        const __m256 g = _mm256_loadu_ps(gp);
        const __m256 t = gelu ? _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(GELU_C3),
                                                                  _mm256_set1_ps(GELU_C1)))
                              : g;
        const __m256 e = exp256_nonpositive(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), t),
                                                          _mm256_set1_ps(88.0f)));
        const __m256 y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.0f))), _mm256_loadu_ps(up8));
        if (n == 8) {
            _mm256_storeu_ps(out + i, y);
        } else {
            _mm256_storeu_ps(o8, y);
            for (int j = 0; j < n; j++) out[i + j] = o8[j];
        }
    }
#else
#pragma omp simd
    for (int64_t i = begin; i < end; i++) {
        const float g = gate[i], t = gelu ? g * (GELU_C1 + GELU_C3 * g * g) : g;
        out[i] = g / (1.0f + vec_exp(-t)) * up[i];
    }
#endif
#endif
}

static inline void silu_mul_span(const float* gate, const float* up, float* out, int64_t begin, int64_t end) {
    act_mul_span(gate, up, out, begin, end, 0);
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
