/* BF16 and F16 weight rows on AVX2 (a bf16 checkpoint's matrices at --dtype bfloat16, an F16/BF16 GGUF's), up to
   WIDE_R activation rows against up to WIDE_C weight rows a pass. The row kernel (quant_blocks.h) keeps four
   accumulators a row, and at eight rows its 32 outgrew AVX2's 16 registers: every add went through memory, and
   each weight row read the eight rows' activations again from L2. Here each (row, output) pair has one
   accumulator, 8 lanes fed by FMAs in the order of the inputs and summed the same way at the end, so an answer
   is the same float whichever pass computed it: a row alone or among 30 others (from WIDE_GEMM_ROWS rows
   widened_gemm.c's panels take the matmul), an output alone or beside its neighbour (the fused step's chunks split pairs where they fall). Six rows against two weight rows keep 12
   accumulators and two widened weights in registers, the activations read once a pass; one row takes four
   weight rows at a time (four streams from memory). */
#ifndef PAGEDSERVE_WIDENED_ROWS_H
#define PAGEDSERVE_WIDENED_ROWS_H
/* included by quant_blocks.h (QUANT_AVX2, the types, PREFETCH_AHEAD), ahead of its row kernel */

#if defined(QUANT_AVX2)
#define WIDE_ROWS 1
#define WIDE_R 6 /* activation rows a pass */
#define WIDE_C 2 /* weight rows a pass at two rows or more */
#define WIDE_C1 4 /* weight rows a pass at one row */
#ifndef WIDE_GEMM_ROWS
#define WIDE_GEMM_ROWS 32 /* from this many rows widened_gemm.c's panels win (x1.05 at 32, x1.4 at 128) */
#endif

static inline int widened_type(int type) { return type == BF16 || type == F16; }

static inline __attribute__((always_inline)) __m256 widened_at(int type, const uint8_t* w, int64_t k) {
    return type == BF16 ? bf16x8_to_ps(w + 2 * k) : halfx8_to_ps(w + 2 * k);
}

static inline float widened_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* y[r * y_pitch + c] = x[r] . w[c] for r < nr, c < nc (w: nc rows of in_dim half-width values, rb bytes apart).
   Inlined with type, nr and nc constants so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void widened_dot_n(int type, const uint8_t* w, int64_t rb,
                                                                 int64_t in_dim, const float* x, int64_t x_pitch,
                                                                 const int nr, const int nc, float* y,
                                                                 int64_t y_pitch) {
    __m256 acc[WIDE_R][WIDE_C1];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < in_dim; k0 += 32) { /* a 64-byte line of each weight row an iteration */
        for (int c = 0; c < nc; c++) __builtin_prefetch(w + c * rb + 2 * k0 + PREFETCH_AHEAD, 0, 3);
        for (int64_t k = k0; k < k0 + 32; k += 8) {
            __m256 wv[WIDE_C1];
            for (int c = 0; c < nc; c++) wv[c] = widened_at(type, w + c * rb, k);
            for (int r = 0; r < nr; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * x_pitch + k);
                for (int c = 0; c < nc; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) y[r * y_pitch + c] = widened_sum(acc[r][c]);
}

#define WIDENED_ROWS_CASES(T, NC)                                                                       \
    switch (nr) {                                                                                       \
        case 1: widened_dot_n(T, w, rb, in_dim, x, x_pitch, 1, NC, y, y_pitch); return;                 \
        case 2: widened_dot_n(T, w, rb, in_dim, x, x_pitch, 2, NC, y, y_pitch); return;                 \
        case 3: widened_dot_n(T, w, rb, in_dim, x, x_pitch, 3, NC, y, y_pitch); return;                 \
        case 4: widened_dot_n(T, w, rb, in_dim, x, x_pitch, 4, NC, y, y_pitch); return;                 \
        case 5: widened_dot_n(T, w, rb, in_dim, x, x_pitch, 5, NC, y, y_pitch); return;                 \
        default: widened_dot_n(T, w, rb, in_dim, x, x_pitch, WIDE_R, NC, y, y_pitch); return;           \
    }

/* One pass: nr <= WIDE_R rows against nc weight rows (1 or WIDE_C; WIDE_C1 at one row). */
static void widened_pass(int type, const uint8_t* w, int64_t rb, int64_t in_dim, const float* x, int64_t x_pitch,
                         int nr, int nc, float* y, int64_t y_pitch) {
    if (nr == 1 && nc == WIDE_C1) {
        if (type == BF16) widened_dot_n(BF16, w, rb, in_dim, x, x_pitch, 1, WIDE_C1, y, y_pitch);
        else widened_dot_n(F16, w, rb, in_dim, x, x_pitch, 1, WIDE_C1, y, y_pitch);
        return;
    }
    if (type == BF16) {
        if (nc == WIDE_C) WIDENED_ROWS_CASES(BF16, WIDE_C)
        WIDENED_ROWS_CASES(BF16, 1)
    }
    if (nc == WIDE_C) WIDENED_ROWS_CASES(F16, WIDE_C)
    WIDENED_ROWS_CASES(F16, 1)
}

/* The weight rows a pass takes at `rows` activation rows, at most `left`. */
static inline int widened_cols(int64_t rows, int64_t left) {
    const int want = rows == 1 ? WIDE_C1 : WIDE_C;
    return left >= want ? want : 1;
}

/* y[r * y_pitch + c] for every activation row r and c < nc: rows in passes of WIDE_R. */
static void widened_rows(int type, const uint8_t* w, int64_t rb, int64_t in_dim, const float* x, int64_t x_pitch,
                         int64_t rows, int nc, float* y, int64_t y_pitch) {
    for (int64_t r0 = 0; r0 < rows; r0 += WIDE_R) {
        const int nr = (int)(rows - r0 < WIDE_R ? rows - r0 : WIDE_R);
        widened_pass(type, w, rb, in_dim, x + r0 * x_pitch, x_pitch, nr, nc, y + r0 * y_pitch, y_pitch);
    }
}

/* Outputs [o0, o1) of y = x @ w^T (w's row 0 is output o0; y rows out_dim long), as many weight rows a pass as
   the rows take; returns o1. */
static int64_t widened_span(int type, const uint8_t* w, int64_t in_dim, const float* x, int64_t rows, int64_t o0,
                            int64_t o1, float* y, int64_t out_dim) {
    const int64_t rb = row_bytes(type, in_dim);
    for (int64_t o = o0; o < o1;) {
        const int nc = widened_cols(rows, o1 - o);
        widened_rows(type, w + (o - o0) * rb, rb, in_dim, x, in_dim, rows, nc, y + o, out_dim);
        o += nc;
    }
    return o1;
}
#else
#define WIDE_ROWS 0
static inline int widened_type(int type) { return (void)type, 0; }
#endif

#endif
