/* Gated DeltaNet's and Mamba2's decode in single passes over fp32 (kernels/delta_rule.py is the definition):
 *   conv_step:       one input per row through the depthwise causal conv and SiLU; the row's last K-1
 *                    inputs in its state slot move on by one, in place
 *   delta_rule_step: one token per row and value head: q, k L2-normalized (q by 1/sqrt(dk) too), the
 *                    state S [dk, dv] decayed by e^g, delta = (v - S^T k) * beta, S += k delta^T, o = S^T q;
 *                    S read once and written once, in its slot (torch gathers, copies and scatters it,
 *                    about five passes over 64 KiB a head)
 *   delta_rule_chunked: one sequence's tokens in chunks of the WY form (kernels/delta_rule.py's
 *                    chunk_gated_delta_rule): a chunk's updates folded into two forward substitutions,
 *                    then the chunk applied to the state in three small matrix products, a head a thread
 *   gated_norm:      each head's output RMS-normed by a plain weight, times SiLU of its gate z
 *   mamba_decode:    Mamba2 from in_proj's output to its gated norm (conv with bias, softplus step sizes,
 *                    the state-space step with the D skip, the norm by groups), as three item kinds the
 *                    fused decode step (decode_step.c) runs too
 * Rows and heads split over OpenMP threads; the inner loops run over dv, contiguous, and vectorize. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedserve.h"
#include "vec_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_DV 512

static inline float silu(float x) { return x / (1.0f + vec_exp(-x)); }
/* torch's softplus: log(1 + e^x), the value itself past 20 */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Channels [c0, c1) of one row through the depthwise causal conv and SiLU: st the row's state [K-1, channels]
   (moved on by one, channel by channel), weight [channels, K] (tap K-1 meets the new input), bias or NULL. */
static void conv_item(const float* weight, const float* bias, float* st, int64_t channels, int32_t kernel,
                      const float* xr, float* o, int32_t c0, int32_t c1) {
    for (int32_t c = c0; c < c1; c++) {
        const float* w = weight + (int64_t)c * kernel;
        float acc = w[kernel - 1] * xr[c] + (bias ? bias[c] : 0.0f);
        for (int32_t j = 0; j < kernel - 1; j++) acc += w[j] * st[(int64_t)j * channels + c];
        o[c] = silu(acc);
        for (int32_t j = 0; j + 1 < kernel - 1; j++) st[(int64_t)j * channels + c] = st[(int64_t)(j + 1) * channels + c];
        st[(int64_t)(kernel - 2) * channels + c] = xr[c];
    }
}

void pagedserve_conv_step(const float* x, int64_t x_stride, float* conv_states, const int64_t* slots,
                          const float* weight, const float* bias, float* out, int64_t rows, int32_t channels,
                          int32_t kernel) {
    /* conv_states [slots, K-1, C]; weight [C, K]; bias [C] or NULL (Mamba2's conv has one); out [rows, C] */
    const int64_t per_slot = (int64_t)(kernel - 1) * channels;
#pragma omp parallel for schedule(static) if (rows * channels > 16384)
    for (int64_t r = 0; r < rows; r++)
        conv_item(weight, bias, conv_states + slots[r] * per_slot, channels, kernel, x + r * x_stride,
                  out + r * channels, 0, channels);
}

/* a . b and y += a x over n floats: AVX2 FMAs eight lanes at a time where the build has them (the library is
   built -std=c11, where plain code is not contracted to FMAs), the rest one by one. */
static inline float dot(const float* a, const float* b, int32_t n) {
    float sum = 0.0f;
    int32_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(float* y, float a, const float* x, int32_t n) {
    int32_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

static inline float inv_norm(const float* x, int32_t n) { return 1.0f / sqrtf(dot(x, x, n) + 1e-6f); }

/* One value head h of one row: x the conv's output row (q: k_heads x dk, then k, then v: v_heads x dv); S the
   head's state [dk, dv] in its slot; o [dv]. Value head h reads key head h % k_heads where tiled (llama.cpp's
   order), else h / (v_heads / k_heads). */
static void delta_head(const float* x, float g, float b, float* S, float* dst, int32_t h, int32_t k_heads,
                       int32_t v_heads, int32_t dk, int32_t dv, int32_t tiled) {
    const int32_t kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const float* q = x + (int64_t)kh * dk;
    const float* k = q + (int64_t)k_heads * dk;
    const float* v = x + 2 * (int64_t)k_heads * dk + (int64_t)h * dv;
    const float qs = inv_norm(q, dk) * (1.0f / sqrtf((float)dk)), ks = inv_norm(k, dk);
    const float decay = vec_exp(g);
    float kv[MAX_DV], delta[MAX_DV], o[MAX_DV];
    for (int32_t j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int32_t i = 0; i < dk; i++) {
        const float ki = k[i] * ks;
        const float* s = S + (int64_t)i * dv;
#pragma omp simd
        for (int32_t j = 0; j < dv; j++) kv[j] += s[j] * ki;
    }
#pragma omp simd
    for (int32_t j = 0; j < dv; j++) {
        delta[j] = (v[j] - decay * kv[j]) * b;
        o[j] = 0.0f;
    }
    for (int32_t i = 0; i < dk; i++) {
        const float ki = k[i] * ks, qi = q[i] * qs;
        float* s = S + (int64_t)i * dv;
#pragma omp simd
        for (int32_t j = 0; j < dv; j++) {
            const float nv = s[j] * decay + ki * delta[j];
            s[j] = nv;
            o[j] += nv * qi;
        }
    }
    for (int32_t j = 0; j < dv; j++) dst[j] = o[j];
}

int pagedserve_delta_rule_step(const float* x, int64_t x_stride, const float* g, const float* beta,
                               float* states, const int64_t* slots, float* out, int64_t rows, int32_t k_heads,
                               int32_t v_heads, int32_t dk, int32_t dv, int32_t tiled) {
    /* x: the conv's output rows; g, beta [rows, v_heads]; states fp32 [slots, v_heads, dk, dv]; out fp32 [rows,
       v_heads, dv]. -1: dv too large. */
    if (dv > MAX_DV || v_heads % k_heads) return -1;
#pragma omp parallel for collapse(2) schedule(static) if (rows * v_heads * dk * dv > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int32_t h = 0; h < v_heads; h++)
            delta_head(x + r * x_stride, g[r * v_heads + h], beta[r * v_heads + h],
                       states + (slots[r] * v_heads + h) * (int64_t)dk * dv, out + (r * v_heads + h) * (int64_t)dv,
                       h, k_heads, v_heads, dk, dv, tiled);
    return 0;
}

/* C[m][n] += alpha * sum_k A[m][k] B[k][n] (m < M, n < N, k < K; each row-major at its own stride), in
   blocks of 4 x 16 kept in eight AVX registers while k runs: the chunk's three products, S sized (dk x dv). */
static void gemm_acc(int32_t M, int32_t N, int32_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                     float* C, int64_t ldc, float alpha) {
    int32_t m0 = 0, n_done = 0;
#if defined(__AVX2__) && defined(__FMA__)
    n_done = N / 16 * 16;
    for (; m0 + 4 <= M; m0 += 4)
        for (int32_t n0 = 0; n0 < n_done; n0 += 16) {
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
            __m256 c20 = c00, c21 = c00, c30 = c00, c31 = c00;
            const float* a = A + m0 * lda;
            for (int32_t k = 0; k < K; k++) {
                const __m256 b0 = _mm256_loadu_ps(B + k * ldb + n0), b1 = _mm256_loadu_ps(B + k * ldb + n0 + 8);
                __m256 x = _mm256_broadcast_ss(a + k);
                c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
                x = _mm256_broadcast_ss(a + lda + k);
                c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
                x = _mm256_broadcast_ss(a + 2 * lda + k);
                c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
                x = _mm256_broadcast_ss(a + 3 * lda + k);
                c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
            }
            const __m256 al = _mm256_set1_ps(alpha);
            __m256 rows[8] = {c00, c01, c10, c11, c20, c21, c30, c31};
            for (int32_t i = 0; i < 8; i++) {
                float* c = C + (m0 + i / 2) * ldc + n0 + (i % 2) * 8;
                _mm256_storeu_ps(c, _mm256_fmadd_ps(al, rows[i], _mm256_loadu_ps(c)));
            }
        }
#endif
    /* what the blocks leave: columns past the last whole 16 of their rows, then the last rows */
    for (int32_t i = 0; i < m0; i++)
        for (int32_t k = 0; k < K && n_done < N; k++)
            for (int32_t j = n_done; j < N; j++) C[i * ldc + j] += alpha * A[i * lda + k] * B[k * ldb + j];
    for (int32_t i = m0; i < M; i++)
        for (int32_t k = 0; k < K; k++) axpy(C + i * ldc, alpha * A[i * lda + k], B + k * ldb, N);
}

/* One head's chunk of L tokens (rows of q, k: dk; v: dv, at stride x_stride) over its state S [dk, dv]: out
   rows at stride out_stride. scratch: 3 * (dk + dv) * C + C * C + 2 * C floats. */
static void wy_chunk(const float* q, const float* k, const float* v, int64_t x_stride, const float* g,
                     const float* beta, int64_t gb_stride, float* S, float* out, int64_t out_stride, int32_t L,
                     int32_t C, int32_t dk, int32_t dv, float q_scale, float* scratch) {
    float *qn = scratch, *kn = qn + (int64_t)C * dk, *U = kn + (int64_t)C * dk, *W = U + (int64_t)C * dv;
    float *F = W + (int64_t)C * dk, *O = F + (int64_t)C * dv, *A = O + (int64_t)C * dv, *gc = A + (int64_t)C * C;
    float* b = gc + C;
    for (int32_t i = 0; i < L; i++) {
        const float *qi = q + i * x_stride, *ki = k + i * x_stride;
        const float qs = inv_norm(qi, dk) * q_scale, ks = inv_norm(ki, dk);
        for (int32_t j = 0; j < dk; j++) {
            qn[i * dk + j] = qi[j] * qs;
            kn[i * dk + j] = ki[j] * ks;
        }
        gc[i] = (i ? gc[i - 1] : 0.0f) + g[i * gb_stride];
        b[i] = beta[i * gb_stride];
    }
    /* (I + A) U = b v and (I + A) W = b e^gc k, A strictly lower: A[i][j] = b_i (k_i . k_j) e^(gc_i - gc_j) */
    for (int32_t i = 0; i < L; i++) {
        float *u = U + (int64_t)i * dv, *w = W + (int64_t)i * dk;
        const float* vi = v + i * x_stride;
        const float eg = vec_exp(gc[i]);
        for (int32_t j = 0; j < dv; j++) u[j] = b[i] * vi[j];
        for (int32_t j = 0; j < dk; j++) w[j] = b[i] * eg * kn[i * dk + j];
        for (int32_t j = 0; j < i; j++) {
            const float a = b[i] * dot(kn + (int64_t)i * dk, kn + (int64_t)j * dk, dk) * vec_exp(gc[i] - gc[j]);
            A[i * C + j] = a;
            axpy(u, -a, U + (int64_t)j * dv, dv);
            axpy(w, -a, W + (int64_t)j * dk, dk);
        }
    }
    /* fresh = U - W S; out_i = e^gc_i q_i S + sum_{j <= i} (q_i . k_j) e^(gc_i - gc_j) fresh_j */
    for (int32_t i = 0; i < L; i++)
        for (int32_t j = 0; j < dv; j++) {
            F[(int64_t)i * dv + j] = U[(int64_t)i * dv + j];
            O[(int64_t)i * dv + j] = 0.0f;
        }
    gemm_acc(L, dv, dk, W, dk, S, dv, F, dv, -1.0f);
    gemm_acc(L, dv, dk, qn, dk, S, dv, O, dv, 1.0f);
    for (int32_t i = 0; i < L; i++) {
        const float eg = vec_exp(gc[i]);
        for (int32_t j = 0; j < C; j++)  /* A's rows now hold the chunk's (q_i . k_j) e^(gc_i - gc_j) */
            A[i * C + j] = j <= i ? dot(qn + (int64_t)i * dk, kn + (int64_t)j * dk, dk) * vec_exp(gc[i] - gc[j]) : 0.0f;
        float* o = O + (int64_t)i * dv;
        for (int32_t j = 0; j < dv; j++) o[j] *= eg;
    }
    gemm_acc(L, dv, L, A, C, F, dv, O, dv, 1.0f);
    for (int32_t i = 0; i < L; i++) {
        float* dst = out + i * out_stride;
        for (int32_t j = 0; j < dv; j++) dst[j] = O[(int64_t)i * dv + j];
    }
    /* S = e^gc_last S + sum_j e^(gc_last - gc_j) k_j fresh_j^T: k's columns scaled, as rows (W's room) */
    const float last = gc[L - 1], el = vec_exp(last);
    for (int32_t j = 0; j < L; j++) b[j] = vec_exp(last - gc[j]);
    for (int32_t kk = 0; kk < dk; kk++)
        for (int32_t j = 0; j < L; j++) W[(int64_t)kk * C + j] = kn[(int64_t)j * dk + kk] * b[j];
    for (int64_t i = 0; i < (int64_t)dk * dv; i++) S[i] *= el;
    gemm_acc(dk, dv, L, W, C, F, dv, S, dv, 1.0f);
}

int pagedserve_delta_rule_chunked(const float* x, int64_t x_stride, const float* g, const float* beta,
                                  float* state, float* out, int64_t tokens, int32_t k_heads, int32_t v_heads,
                                  int32_t dk, int32_t dv, int32_t tiled, int32_t chunk) {
    /* One sequence's tokens: x rows as delta_rule_step's, g and beta [tokens, v_heads], state fp32 [v_heads,
       dk, dv] (its slot) moved past them, out fp32 [tokens, v_heads, dv]. -1: shapes it does not take, or no
       memory (nothing changed). */
    if (v_heads % k_heads || chunk < 1 || tokens < 1) return -1;
    const int32_t group = v_heads / k_heads;
    const float q_scale = 1.0f / sqrtf((float)dk);
    const int64_t per = 3 * ((int64_t)dk + dv) * chunk + (int64_t)chunk * chunk + 2 * chunk;
    int failed = 0;
#pragma omp parallel
    {
        float* scratch = malloc(sizeof(float) * per);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int32_t h = 0; h < v_heads; h++) {
                const int32_t kh = tiled ? h % k_heads : h / group;
                float* S = state + (int64_t)h * dk * dv;
                for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
                    const int32_t L = (int32_t)(tokens - c0 < chunk ? tokens - c0 : chunk);
                    const float* row = x + c0 * x_stride;
                    wy_chunk(row + (int64_t)kh * dk, row + ((int64_t)k_heads + kh) * dk,
                             row + 2 * (int64_t)k_heads * dk + (int64_t)h * dv, x_stride, g + c0 * v_heads + h,
                             beta + c0 * v_heads + h, v_heads, S, out + (c0 * v_heads + h) * dv,
                             (int64_t)v_heads * dv, L, chunk, dk, dv, q_scale, scratch);
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* One head's output x [dim] RMS-normed by the plain weight, times SiLU of its gate. */
static void gated_norm_head(const float* x, const float* gate, const float* weight, float* dst, int32_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int32_t j = 0; j < dim; j++) sum += x[j] * x[j];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int32_t j = 0; j < dim; j++) dst[j] = weight[j] * (x[j] * inv) * silu(gate[j]);
}

void pagedserve_gated_norm(const float* o, const float* z, int64_t z_stride, const float* weight, float* out,
                           int64_t rows, int32_t heads, int32_t dim, float eps) {
    /* o [rows, heads, dim]; z: each row's gates at z + r * z_stride, [heads, dim]; out [rows, heads * dim] */
#pragma omp parallel for collapse(2) schedule(static) if (rows * heads * dim > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int32_t h = 0; h < heads; h++)
            gated_norm_head(o + (r * heads + h) * (int64_t)dim, z + r * z_stride + (int64_t)h * dim, weight,
                            out + (r * heads + h) * (int64_t)dim, dim, eps);
}

/* --- Mamba2's decode as three item kinds, for the layer path's one call and the fused step ----------------- */

static inline int64_t mamba_inner(const PsMamba* mb) { return (int64_t)mb->heads * mb->head_dim; }
static inline int64_t mamba_conv_dim(const PsMamba* mb) {
    return mamba_inner(mb) + 2 * (int64_t)mb->groups * mb->d_state;
}

/* 0 where the fields describe a mixer these stages serve, else -1 */
int pagedserve_mamba_checks(const PsMamba* mb) {
    if (!mb || !mb->conv || !mb->dt_bias || !mb->a || !mb->d || !mb->conv_states || !mb->ssm_states)
        return -1;
    if (mb->heads < 1 || mb->head_dim < 1 || mb->groups < 1 || mb->heads % mb->groups || mb->d_state < 1
        || mb->kernel < 2 || mb->norm_kind < 0 || mb->norm_kind > 2 || (mb->norm_kind && !mb->norm)
        || mamba_inner(mb) % mb->groups)
        return -1;
    return 0;
}

static void mamba_conv(const PsMamba* mb, const float* xbc, float* conv_out, int64_t slot, int32_t c0, int32_t c1) {
    const int64_t channels = mamba_conv_dim(mb);
    conv_item(mb->conv, mb->conv_bias, mb->conv_states + slot * (int64_t)(mb->kernel - 1) * channels, channels,
              mb->kernel, xbc, conv_out, c0, c1);
}

/* Head h: its step size softplus(raw + bias), floored at dt_min; the state
   decayed by e^(dt a), dt x (outer) B added, y = state . C + D x. */
static void mamba_head(const PsMamba* mb, const float* conv_out, const float* dt_raw, float* y, int64_t slot,
                       int32_t h) {
    const int32_t hd = mb->head_dim, n = mb->d_state;
    const int64_t inner = mamba_inner(mb), per_head = (int64_t)hd * n;
    float step = softplus(dt_raw[h] + mb->dt_bias[h]);
    step = step < mb->dt_min ? mb->dt_min : step;
    const float decay = vec_exp(step * mb->a[h]);
    const float* x = conv_out + (int64_t)h * hd;
    const float* b = conv_out + inner + (int64_t)(h / (mb->heads / mb->groups)) * n;
    const float* c = b + (int64_t)mb->groups * n;
    float* s = mb->ssm_states + slot * mb->heads * per_head + (int64_t)h * per_head;
    float* out = y + (int64_t)h * hd;
    for (int32_t p = 0; p < hd; p++) {
        float* sp = s + (int64_t)p * n;
        for (int32_t i = 0; i < n; i++) sp[i] *= decay;
        axpy(sp, step * x[p], b, n);
        out[p] = dot(sp, c, n) + mb->d[h] * x[p];
    }
}

/* Group g of a row: y times SiLU(z), RMS-normed over the group and times the norm's weight (norm_kind 1);
   normed first, then gated (2); or the gate alone (0). */
static void mamba_norm(const PsMamba* mb, const float* y, const float* z, float* out, int32_t g) {
    const int64_t width = mamba_inner(mb) / mb->groups, at = g * width;
    float sum = 0.0f;
    for (int64_t j = at; j < at + width; j++) {
        const float v = mb->norm_kind == 2 ? y[j] : y[j] * silu(z[j]);
        out[j] = v;
        sum += v * v;
    }
    if (mb->norm_kind == 0) return;
    const float inv = 1.0f / sqrtf(sum / (float)width + mb->eps);
    for (int64_t j = at; j < at + width; j++) {
        const float v = mb->norm[j] * (out[j] * inv);
        out[j] = mb->norm_kind == 2 ? v * silu(z[j]) : v;
    }
}

/* The three stages for `rows` rows, each an `omp for` over its items: called inside a parallel region (the
   fused step's, or pagedserve_mamba_decode's). proj rows proj_stride apart; conv_out [rows, conv_dim], y and out
   [rows, inner]. */
void pagedserve_mamba_stages(const PsMamba* mb, const float* proj, int64_t proj_stride, const int64_t* slots,
                             int64_t rows, float* conv_out, float* y, float* out) {
    const int64_t inner = mamba_inner(mb), conv_dim = mamba_conv_dim(mb);
    const int64_t chunks = (conv_dim + PS_MAMBA_CONV_CHUNK - 1) / PS_MAMBA_CONV_CHUNK;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * chunks; it++) {
        const int64_t r = it / chunks, c0 = it % chunks * PS_MAMBA_CONV_CHUNK;
        const int64_t c1 = c0 + PS_MAMBA_CONV_CHUNK < conv_dim ? c0 + PS_MAMBA_CONV_CHUNK : conv_dim;
        mamba_conv(mb, proj + r * proj_stride + inner, conv_out + r * conv_dim, slots[r], (int32_t)c0, (int32_t)c1);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * mb->heads; it++) {
        const int64_t r = it / mb->heads;
        mamba_head(mb, conv_out + r * conv_dim, proj + r * proj_stride + inner + conv_dim, y + r * inner, slots[r],
                   (int32_t)(it % mb->heads));
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * mb->groups; it++) {
        const int64_t r = it / mb->groups;
        mamba_norm(mb, y + r * inner, proj + r * proj_stride, out + r * inner, (int32_t)(it % mb->groups));
    }
}

int pagedserve_mamba_decode(const PsMamba* mb, const float* proj, int64_t proj_stride, const int64_t* slots,
                            int64_t rows, float* out, float* scratch) {
    if (pagedserve_mamba_checks(mb) || rows < 0) return -1;
    const int64_t inner = mamba_inner(mb), conv_dim = mamba_conv_dim(mb);
    if (proj_stride < inner + conv_dim + mb->heads) return -1;
#pragma omp parallel if (rows * inner * mb->d_state > 65536)
    pagedserve_mamba_stages(mb, proj, proj_stride, slots, rows, scratch, scratch + rows * conv_dim, out);
    return 0;
}

/* --- Gated DeltaNet's decode as three item kinds, for the layer path's one call and the fused step -------- */

static inline int64_t delta_conv_dim(const PsDelta* dl) {
    return 2 * (int64_t)dl->k_heads * dl->dk + (int64_t)dl->v_heads * dl->dv;
}

int pagedserve_delta_checks(const PsDelta* dl) {
    if (!dl || !dl->conv || !dl->dt_bias || !dl->a_neg || !dl->norm || !dl->conv_states || !dl->states) return -1;
    if (dl->k_heads < 1 || dl->v_heads % dl->k_heads || dl->dk < 1 || dl->dv < 1 || dl->dv > MAX_DV
        || dl->kernel < 2)
        return -1;
    return 0;
}

void pagedserve_delta_stages(const PsDelta* dl, const float* proj, int64_t proj_stride, const int64_t* slots,
                             int64_t rows, float* conv_out, float* o, float* out) {
    const int64_t conv_dim = delta_conv_dim(dl), v_size = (int64_t)dl->v_heads * dl->dv, K = dl->kernel;
    const int64_t chunks = (conv_dim + PS_MAMBA_CONV_CHUNK - 1) / PS_MAMBA_CONV_CHUNK;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * chunks; it++) {
        const int64_t r = it / chunks, c0 = it % chunks * PS_MAMBA_CONV_CHUNK;
        const int64_t c1 = c0 + PS_MAMBA_CONV_CHUNK < conv_dim ? c0 + PS_MAMBA_CONV_CHUNK : conv_dim;
        conv_item(dl->conv, NULL, dl->conv_states + slots[r] * (K - 1) * conv_dim, conv_dim, (int32_t)K,
                  proj + r * proj_stride, conv_out + r * conv_dim, (int32_t)c0, (int32_t)c1);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * dl->v_heads; it++) { /* b then a after x and z: beta and the decay */
        const int64_t r = it / dl->v_heads;
        const int32_t h = (int32_t)(it % dl->v_heads);
        const float* ba = proj + r * proj_stride + conv_dim + v_size;
        const float beta = 1.0f / (1.0f + expf(-ba[h])) * dl->beta_scale;
        const float g = dl->a_neg[h] * softplus(ba[dl->v_heads + h] + dl->dt_bias[h]);
        delta_head(conv_out + r * conv_dim, g, beta, dl->states + (slots[r] * dl->v_heads + h) * (int64_t)dl->dk * dl->dv,
                   o + r * v_size + (int64_t)h * dl->dv, h, dl->k_heads, dl->v_heads, dl->dk, dl->dv, dl->tiled);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * dl->v_heads; it++) {
        const int64_t r = it / dl->v_heads, at = it % dl->v_heads * dl->dv;
        gated_norm_head(o + r * v_size + at, proj + r * proj_stride + conv_dim + at, dl->norm, out + r * v_size + at,
                        dl->dv, dl->eps);
    }
}

int pagedserve_delta_decode(const PsDelta* dl, const float* proj, int64_t proj_stride, const int64_t* slots,
                            int64_t rows, float* out, float* scratch) {
    if (pagedserve_delta_checks(dl) || rows < 0) return -1;
    const int64_t conv_dim = delta_conv_dim(dl), v_size = (int64_t)dl->v_heads * dl->dv;
    if (proj_stride < conv_dim + v_size + 2 * dl->v_heads) return -1;
#pragma omp parallel if (rows * v_size * dl->dk > 32768)
    pagedserve_delta_stages(dl, proj, proj_stride, slots, rows, scratch, scratch + rows * conv_dim, out);
    return 0;
}
