/* Many rows against BF16/F16 weights where AVX2 is the widest the CPU has (a bf16 checkpoint's prompt steps at
   --dtype bfloat16, an F16 GGUF's): y[r, o] = sum_k x[r, k] * W[o, k], x and y fp32.

   The row passes (widened_rows.h) keep one 8-lane chain a (row, output) pair; each weight vector they widen
   feeds six FMAs and each activation vector two, so loads and widening, not the FMA ports, set the pace (~45% of
   the machine's FMA rate). Here a thread takes GEMM_NB outputs at a time and widens GEMM_KC inputs of them once
   into panels of 16 outputs, input-major (64 KiB, held in L2); six rows then multiply each panel as an outer
   product: one broadcast activation and two panel vectors feed twelve accumulators, 6 x 16 outputs held in
   registers over the chunk. The rows are first packed six at a time, input-major, so a pass's broadcasts share a
   cache line whatever stride in_dim gives (a power of two aliases every row into a few cache sets), and taken in
   blocks of GEMM_MC so a block's activations stay near while the four panels pass (x1.3-2 at 512-2048 rows).
   Each output is one fp32 chain in input order, whichever rows share its step. pagedserve_quant_matmul sends
   BF16/F16 matmuls of WIDE_GEMM_ROWS rows or more here; below that the widening, paid once a weight a call,
   costs more than the row passes lose. */
#include <stdlib.h>
#include <string.h>

#include "pagedserve.h"
#include "quant_blocks.h"

#if WIDE_ROWS
#define GEMM_KC 256 /* inputs a chunk: a panel is 16 x 256 fp32, 16 KiB */
#define GEMM_NB 64  /* outputs a thread's block: four panels */
#define GEMM_MC 48  /* rows a block: 48 x 256 packed activations, 48 KiB, stay in L1/L2 while the panels pass */
#define GEMM_MR 6   /* rows a pass: 12 accumulators, two panel vectors and a broadcast in 15 registers */

/* t[i] = lane i of every v[q]: an 8 x 8 transpose in registers. */
static inline void transpose8(__m256 v[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            b[i + h] = _mm256_shuffle_ps(a[i + h], a[i + 2 + h], _MM_SHUFFLE(1, 0, 1, 0));
            b[i + 2 + h] = _mm256_shuffle_ps(a[i + h], a[i + 2 + h], _MM_SHUFFLE(3, 2, 3, 2));
        }
    const int order[4] = {0, 2, 1, 3};
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2f128_ps(b[order[i]], b[4 + order[i]], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(b[order[i]], b[4 + order[i]], 0x31);
    }
}

/* Outputs [o0, o0 + n) (n <= GEMM_NB), inputs [k0, k0 + kc), widened into P[p][k][16], eight outputs by eight
   inputs a transpose; outputs past n are zero. */
static void pack_panels(int type, const uint8_t* w, int64_t in_dim, int64_t n, int64_t k0, int64_t kc, float* P) {
    const int64_t rb = row_bytes(type, in_dim);
    for (int64_t j = 0; j < (n + 15) / 16 * 16; j += 8) {
        float* col = P + j / 16 * GEMM_KC * 16 + j % 16;
        for (int64_t k = 0; k < kc; k += 8) {
            __m256 v[8];
            for (int q = 0; q < 8; q++)
                v[q] = j + q < n ? widened_at(type, w + (j + q) * rb, k0 + k) : _mm256_setzero_ps();
            transpose8(v);
            for (int i = 0; i < 8; i++) _mm256_store_ps(col + (k + i) * 16, v[i]);
        }
    }
}

/* Rows [6t, 6t + 6) of x into X[t][k][6], one tile a thread at a time, rows past `rows` zero: a pass's six
   broadcasts then come from one cache line, whatever stride in_dim puts between the rows. */
static void pack_rows(const float* x, int64_t rows, int64_t in_dim, float* X) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (rows + GEMM_MR - 1) / GEMM_MR; t++) {
        float* d = X + t * GEMM_MR * in_dim;
        for (int r = 0; r < GEMM_MR; r++) {
            const float* s = x + (t * GEMM_MR + r) * in_dim;
            if (t * GEMM_MR + r < rows)
                for (int64_t k = 0; k < in_dim; k++) d[k * GEMM_MR + r] = s[k];
            else
                for (int64_t k = 0; k < in_dim; k++) d[k * GEMM_MR + r] = 0.0f;
        }
    }
}

/* y[r][0..16) (+)= X tile[0..kc) . panel for r < nr: inlined with nr a constant so the 2 * nr accumulators are
   registers. Each output is one chain in input order whatever nr is. */
static inline __attribute__((always_inline)) void gemm_rows(const float* P, const float* X, int nr, int64_t kc,
                                                           float* y, int64_t yp, int first) {
    __m256 c[GEMM_MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
        for (int h = 0; h < 2; h++) c[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * yp + 8 * h);
    for (int64_t k = 0; k < kc; k++) {
        const __m256 p0 = _mm256_load_ps(P + 16 * k), p1 = _mm256_load_ps(P + 16 * k + 8);
#pragma GCC unroll 6
        for (int r = 0; r < nr; r++) {
            const __m256 b = _mm256_broadcast_ss(X + GEMM_MR * k + r);
            c[r][0] = _mm256_fmadd_ps(b, p0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(b, p1, c[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + r * yp + 8 * h, c[r][h]);
}

static void gemm_nr(const float* P, const float* X, int nr, int64_t kc, float* y, int64_t yp, int first) {
    switch (nr) {
        case 6: return gemm_rows(P, X, 6, kc, y, yp, first);
        case 5: return gemm_rows(P, X, 5, kc, y, yp, first);
        case 4: return gemm_rows(P, X, 4, kc, y, yp, first);
        case 3: return gemm_rows(P, X, 3, kc, y, yp, first);
        case 2: return gemm_rows(P, X, 2, kc, y, yp, first);
        default: return gemm_rows(P, X, 1, kc, y, yp, first);
    }
}

/* One panel's 16 outputs for rows [0, rows) of a block (X at its first tile and chunk), `cols` of them kept (a
   block's last panel may hold fewer): rows in passes of six, a partial panel through a 6 x 16 scratch so y's
   neighbours are never written. */
static void gemm_panel(const float* P, const float* X, int64_t rows, int64_t in_dim, int64_t kc, float* y,
                       int64_t out_dim, int cols, int first) {
    float edge[GEMM_MR * 16];
    for (int64_t r0 = 0; r0 < rows; r0 += GEMM_MR) {
        const int nr = (int)(rows - r0 < GEMM_MR ? rows - r0 : GEMM_MR);
        float* yr = y + r0 * out_dim;
        float* t = cols == 16 ? yr : edge;
        const int64_t tp = cols == 16 ? out_dim : 16;
        if (cols < 16 && !first)
            for (int r = 0; r < nr; r++) memcpy(edge + r * 16, yr + r * out_dim, cols * sizeof(float));
        gemm_nr(P, X + r0 * in_dim, nr, kc, t, tp, first);
        if (cols < 16)
            for (int r = 0; r < nr; r++) memcpy(yr + r * out_dim, edge + r * 16, cols * sizeof(float));
    }
}

/* Returns 0, -1 where the type is not half-width or AVX2 is not the widest vector, -2 when a panel cannot be
   allocated. */
int pagedserve_widened_gemm(const float* x, int64_t rows, int64_t in_dim, const uint8_t* w, int64_t out_dim,
                            int32_t type, float* y) {
    if (!widened_type(type) || in_dim % 32) return -1;
    const int64_t blocks = (out_dim + GEMM_NB - 1) / GEMM_NB, rb = row_bytes(type, in_dim);
    float* X = aligned_alloc(64, (rows + GEMM_MR - 1) / GEMM_MR * GEMM_MR * in_dim * sizeof(float));
    if (!X) return -2;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        pack_rows(x, rows, in_dim, X);
        float* P = aligned_alloc(64, GEMM_NB * GEMM_KC * sizeof(float));
        failed = !P;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t o0 = b * GEMM_NB, n = out_dim - o0 < GEMM_NB ? out_dim - o0 : GEMM_NB;
            for (int64_t k0 = 0; P && k0 < in_dim; k0 += GEMM_KC) {
                const int64_t kc = in_dim - k0 < GEMM_KC ? in_dim - k0 : GEMM_KC;
                pack_panels(type, w + o0 * rb, in_dim, n, k0, kc, P);
                for (int64_t r0 = 0; r0 < rows; r0 += GEMM_MC) {
                    const int64_t mr = rows - r0 < GEMM_MC ? rows - r0 : GEMM_MC;
                    for (int64_t p = 0; p * 16 < n; p++) {
                        const int cols = (int)(n - p * 16 < 16 ? n - p * 16 : 16);
                        gemm_panel(P + p * GEMM_KC * 16, X + r0 * in_dim + k0 * GEMM_MR, mr, in_dim, kc,
                                   y + r0 * out_dim + o0 + p * 16, out_dim, cols, k0 == 0);
                    }
                }
            }
        }
        free(P);
    }
    free(X);
    return failed ? -2 : 0;
}
#else
int pagedserve_widened_gemm(const float* x, int64_t rows, int64_t in_dim, const uint8_t* w, int64_t out_dim,
                            int32_t type, float* y) {
    (void)x, (void)rows, (void)in_dim, (void)w, (void)out_dim, (void)type, (void)y;
    return -1;
}
#endif
