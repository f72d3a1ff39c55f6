/* The elementwise tail of a Llama layer in single passes over fp32 rows, split over OpenMP threads:
 *   add_rms_norm: residual += delta (optional), out = residual * rsqrt(mean(residual^2) + eps) * weight
 *   silu_mul:     out[:, i] = silu(gate_up[:, i]) * gate_up[:, I + i]
 *   rope:         rotate-half RoPE in place on the first `heads` heads of each row (q then k of a fused QKV row)
 *   head_rms_norm: RMSNorm of each head in place (Qwen3's q and k norms, on the fused QKV row)
 * Torch spends 4-6 passes (and temporaries) on each; here each element is read and written once.
 * Accumulation in fp32 as the torch code does; exp through vec_math.h, which vectorizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedserve.h"
#include "convert.h"
#include "rows.h"
#include "kv_rows.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void pagedserve_add_rms_norm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                             int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(residual + r * dim, delta ? delta + r * dim : 0, weight, out + r * dim, dim, eps);
}

/* add_rms_norm beside bf16 GEMMs: the delta fp32 or bf16 (a bf16 GEMM's output), the normed row fp32 or rounded
   to bf16 for the next bf16 GEMM; the residual stream stays fp32. add_rms_norm_row itself on the row widened
   into a thread's scratch (so every sum is the fp32 kernel's, bit for bit), the output rounded to nearest even
   as torch rounds: one pass over memory where widening, the norm and narrowing took three. */
void pagedserve_add_rms_norm_mixed(float* residual, const void* delta, int32_t delta_bf16, const float* weight,
                                   void* out, int32_t out_bf16, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel if (rows * dim > 32768)
    {
        float* scratch = (float*)malloc(sizeof(float) * 2 * (size_t)dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float* d = 0;
            if (delta && delta_bf16) {
                const uint16_t* src = (const uint16_t*)delta + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) scratch[i] = bf16_to_float(src[i]);
                d = scratch;
            } else if (delta) {
                d = (const float*)delta + r * dim;
            }
            float* o = out_bf16 ? scratch + dim : (float*)out + r * dim;
            add_rms_norm_row(residual + r * dim, d, weight, o, dim, eps);
            if (out_bf16) {
                uint16_t* dst = (uint16_t*)out + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) dst[i] = float_to_bf16_nobranch(o[i]);
            }
        }
        free(scratch);
    }
}

void pagedserve_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, 0, inter);
}

/* silu_mul on bf16 rows (a bf16 GEMM's gate/up): the same fp32 arithmetic on the widened values, the product
   rounded to bf16 (nearest even, as torch rounds) for the next bf16 GEMM. */
void pagedserve_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* g = gate_up + r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + r * inter;
        for (int64_t c = 0; c < inter; c += 512) { /* widened (exactly) into L1, silu_mul_span, rounded back */
            const int n = inter - c < 512 ? (int)(inter - c) : 512;
            float gw[512], uw[512], yw[512];
            for (int i = 0; i < n; i++) {
                gw[i] = bf16_to_float(g[c + i]);
                uw[i] = bf16_to_float(u[c + i]);
            }
            silu_mul_span(gw, uw, yw, 0, n);
            for (int i = 0; i < n; i++) o[c + i] = float_to_bf16_nobranch(yw[i]);
        }
    }
}

/* bf16 -> fp32 of n values (a bf16 GEMM's output for the fp32 residual stream): exact, a 16-bit shift a value,
   both threads on their own halves; torch's own conversion runs one scalar thread. */
void pagedserve_widen_bf16(const uint16_t* src, float* dst, int64_t n) {
    const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t c = 0; c < n; c += chunk) {
        const int64_t end = c + chunk < n ? c + chunk : n;
#pragma omp simd
        for (int64_t i = c; i < end; i++) dst[i] = bf16_to_float(src[i]);
    }
}

/* Each token's keys and values (width = n_kv_heads * head_dim floats at k + t * row_stride, the fused QKV row's
   views) into the pool at its slot, fp32 or rounded to bf16; a slot of -1 (padding) writes nothing. One pass,
   where torch converted the strided views and then scattered them. */
void pagedserve_write_kv(const float* k, const float* v, int64_t row_stride, void* k_cache, void* v_cache,
                         const int64_t* slots, int64_t n, int32_t width, int32_t kv_bf16) {
#pragma omp parallel for schedule(static) if (n * width > 32768)
    for (int64_t t = 0; t < n; t++) {
        if (slots[t] < 0) continue;
        kv_store(k_cache, slots[t] * width, kv_bf16, k + t * row_stride, width);
        kv_store(v_cache, slots[t] * width, kv_bf16, v + t * row_stride, width);
    }
}

void pagedserve_rope(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                     const float* cos_table, const float* sin_table, const int64_t* positions, int32_t half) {
    /* half: the tables' width, rotary_dim / 2 (head_dim / 2 unless a partial_rotary_factor leaves the
       rest of each head unrotated) */
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope_head(x + r * row_stride + (int64_t)h * head_dim, cos_table + positions[r] * half,
                      sin_table + positions[r] * half, half);
}

void pagedserve_head_rms_norm(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                              const float* weight, float eps) {
    /* the fused decode step's arithmetic (add_rms_norm_row in place), so a prompt's keys and a decoded
       token's are normalized alike */
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float* v = x + r * row_stride + (int64_t)h * head_dim;
            add_rms_norm_row(v, 0, weight, v, head_dim, eps);
        }
}

/* Greedy choice of each row of logits: out[r] = the first index of the row's largest value, NaN never
   chosen (as -inf), -1 for a row with nothing above -inf. One pass, one thread a row: a vocabulary of 50k
   is ~10 us, where torch's reductions took ~10x that between a decode step's parallel regions. */
void pagedserve_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * n;
        float best = -INFINITY;
        int64_t at = -1, i = 0;
#if defined(__AVX512F__)
        if (n < (int64_t)1 << 31) { /* per lane: its first largest value (strictly greater replaces) */
            __m512 vbest = _mm512_set1_ps(-INFINITY);
            __m512i vat = _mm512_set1_epi32(-1), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i step = _mm512_set1_epi32(16);
            for (; i + 16 <= n; i += 16) {
                const __m512 v = _mm512_loadu_ps(row + i);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ); /* false for NaN */
                vbest = _mm512_mask_mov_ps(vbest, gt, v);
                vat = _mm512_mask_mov_epi32(vat, gt, idx);
                idx = _mm512_add_epi32(idx, step);
            }
            float lb[16];
            int32_t la[16];
            _mm512_storeu_ps(lb, vbest);
            _mm512_storeu_epi32(la, vat);
            for (int l = 0; l < 16; l++) /* across lanes: the largest, then the smallest index */
                if (la[l] >= 0 && (lb[l] > best || (lb[l] == best && la[l] < at))) {
                    best = lb[l];
                    at = la[l];
                }
        }
#endif
        for (; i < n; i++) {
            if (row[i] > best) { /* false for NaN, and for -inf while nothing better was seen */
                best = row[i];
                at = i;
            }
        }
        out[r] = at;
    }
}
