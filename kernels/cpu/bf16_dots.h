/* BF16 weight rows on AVX512_BF16 without AMX tiles (Zen 4 and 5, Cooper Lake): `vdpbf16ps` adds 16 lanes of
   two bf16 products each into fp32, 32 products an instruction against the row kernel's 16 (quant_blocks.h,
   which widens each weight to fp32 and loads every activation row per block for one FMA each: past four rows
   it is bound by those loads, x1.4-6 slower, and the start-up calibration sent every wider step to oneDNN).
   On Zen 5 these run a 1B model's matrices at x0.92-1.12 of oneDNN's blocked copy to 64 rows and x1.2-1.8 of
   oneDNN on the weights as held (where memory holds no copy); docs/BENCHMARKS.md.

   A pass takes DOT_R activation rows against DOT_C weight rows (DOT_C1 at one row): 32 values of each row a
   step, one accumulator a (row, output) pair, its 16 lanes summed in a fixed order at the end, so an answer is
   the same float whichever pass computed it: a row alone or among 60 others, an output wherever a chunk cuts
   the matrix. Precision: each activation is rounded to bf16 once (as oneDNN's bf16 GEMM, the AMX tiles
   (amx_bf16.h) and a bf16 model's own layers do); the weights exact, each pair's sum rounded to fp32. */
#ifndef PAGEDSERVE_BF16_DOTS_H
#define PAGEDSERVE_BF16_DOTS_H
#include <stdint.h>

/* 1 where BF16 rows take these dot products: built for them and not turned off (pagedserve_bf16_rounded). */
int bf16_dots_ready(void);

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(__AMX_BF16__)
#define BF16_DOTS 1
#include <immintrin.h>

#define DOT_R 6  /* activation rows a pass */
#define DOT_C 4  /* weight rows a pass at two rows or more */
#define DOT_C1 8 /* weight rows a pass at one row */

/* The next outputs' weight lines asked for into L2 while these are multiplied: `per` lines a step of 32 inputs,
   from `at` to `end`. Without them a span's first pass of rows waited on memory and the rest computed from
   cache, one after the other (x1.05-1.19 at 4-64 rows); one row streams without them (x0.9 with). */
typedef struct {
    const char *at, *end;
    int per;
} DotAhead;

/* Row r of x [rows, in_dim] rounded to bf16 (nearest, ties to even) into xb as its pass reads it: the pass's np
   rows (DOT_R, fewer in the last) 32 values at a time, row after row, so the pass reads one stream. Rows one
   in_dim apart (a power of two) aliased into a few L1 sets. */
static inline void dots_x_row(const float *x, int64_t rows, int64_t in_dim, uint16_t *xb, int64_t r) {
    const int64_t r0 = r / DOT_R * DOT_R, np = rows - r0 < DOT_R ? rows - r0 : DOT_R;
    const float *s = x + r * in_dim;
    uint16_t *d = xb + r0 * in_dim + (r - r0) * 32;
    for (int64_t k = 0; k < in_dim; k += 32)
        _mm512_storeu_si512(d + k * np,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k)));
}

/* The lane sums of a, b, c and d, in one order for every accumulator (a missing one passed as zeros: adding them
   changes no sum), in 12 instructions where four reductions take ~32. */
static inline __m128 dots_sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q), _mm512_extractf32x8_ps(q, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* y[r * y_pitch + c] = x[r] . w[c] for r < nr, c < nc (w: nc rows of in_dim bf16 values; xb a pass of nr rows as
   dots_x_row lays them). Inlined with nr and nc constants so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots_n(const uint16_t *w, int64_t in_dim, const uint16_t *xb,
                                                        int64_t k0, int64_t k1, const int nr, const int nc, float *y,
                                                        int64_t y_pitch, DotAhead *ahead) {
    const char *pf = ahead->at;
    __m512 acc[DOT_R][DOT_C1];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 32) {
        __m512bh wv[DOT_C1];
        for (int i = 0; i < ahead->per && pf < ahead->end; i++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        for (int c = 0; c < nc; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * in_dim + k);
        for (int r = 0; r < nr; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + k * nr + r * 32);
            for (int c = 0; c < nc; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c += 4) {
            const __m512 z = _mm512_setzero_ps();
            float sums[4];
            _mm_storeu_ps(sums, dots_sum4(acc[r][c], nc > c + 1 ? acc[r][c + 1] : z, nc > c + 2 ? acc[r][c + 2] : z,
                                          nc > c + 3 ? acc[r][c + 3] : z));
            for (int i = 0; i < 4 && c + i < nc; i++)
                y[r * y_pitch + c + i] = (k0 ? y[r * y_pitch + c + i] : 0.0f) + sums[i];
        }
    ahead->at = pf;
}

#define DOTS_CASES(NC)                                                               \
    switch (nr) {                                                                    \
        case 1: dots_n(w, in_dim, xb, k0, k1, 1, NC, y, y_pitch, ahead); return;     \
        case 2: dots_n(w, in_dim, xb, k0, k1, 2, NC, y, y_pitch, ahead); return;     \
        case 3: dots_n(w, in_dim, xb, k0, k1, 3, NC, y, y_pitch, ahead); return;     \
        case 4: dots_n(w, in_dim, xb, k0, k1, 4, NC, y, y_pitch, ahead); return;     \
        case 5: dots_n(w, in_dim, xb, k0, k1, 5, NC, y, y_pitch, ahead); return;     \
        default: dots_n(w, in_dim, xb, k0, k1, DOT_R, NC, y, y_pitch, ahead); return; \
    }

/* One pass: nr <= DOT_R rows against nc weight rows (1, DOT_C, or DOT_C1 at one row), inputs [k0, k1). */
static void dots_pass(const uint16_t *w, int64_t in_dim, const uint16_t *xb, int64_t k0, int64_t k1, int nr, int nc,
                      float *y, int64_t y_pitch, DotAhead *ahead) {
    if (nr == 1 && nc == DOT_C1) {
        dots_n(w, in_dim, xb, k0, k1, 1, DOT_C1, y, y_pitch, ahead);
        return;
    }
    if (nc == DOT_C) DOTS_CASES(DOT_C)
    DOTS_CASES(1)
}

/* Outputs [o0, o1) of y = xb @ w^T for `rows` rows (w's row 0 is output o0; y rows out_dim long); returns o1.
   In spans of DOT_K inputs (a pass's activations stay in L1 while the span's weight rows stream past them
   from L2; at 8,192 inputs x1.25 at 32-128 rows), each pass of rows against every group of weight rows. An
   output sums its spans in order, so its float is still the same whatever else is multiplied. */
#define DOT_K 2048
static int64_t dots_span(const uint16_t *w, int64_t in_dim, const uint16_t *xb, int64_t rows, int64_t o0, int64_t o1,
                         float *y, int64_t out_dim, int64_t o_end) {
    const int want = rows == 1 ? DOT_C1 : DOT_C;
    if (rows <= 0 || o1 <= o0) return o1;
    const int64_t passes = (rows + DOT_R - 1) / DOT_R, groups = (o1 - o0 + want - 1) / want;
    const int64_t next = o1 + (o1 - o0) < o_end ? o1 + (o1 - o0) : o_end;
    DotAhead ahead = {(const char *)(w + (o1 - o0) * in_dim), (const char *)(w + (next - o0) * in_dim),
                      rows == 1 ? 0 : (int)((o1 - o0 + passes * groups - 1) / (passes * groups))};
    if (rows <= DOT_R) { /* one pass of rows: each group of weight rows read through, span after span */
        for (int64_t o = o0; o < o1;) {
            const int nc = o1 - o >= want ? want : 1;
            for (int64_t k0 = 0; k0 < in_dim; k0 += DOT_K)
                dots_pass(w + (o - o0) * in_dim, in_dim, xb, k0, k0 + DOT_K < in_dim ? k0 + DOT_K : in_dim, (int)rows,
                          nc, y + o, out_dim, &ahead);
            o += nc;
        }
        return o1;
    }
    for (int64_t k0 = 0; k0 < in_dim; k0 += DOT_K) {
        const int64_t k1 = k0 + DOT_K < in_dim ? k0 + DOT_K : in_dim;
        for (int64_t r0 = 0; r0 < rows; r0 += DOT_R) {
            const int nr = (int)(rows - r0 < DOT_R ? rows - r0 : DOT_R);
            for (int64_t o = o0; o < o1;) {
                const int nc = o1 - o >= want ? want : 1;
                dots_pass(w + (o - o0) * in_dim, in_dim, xb + r0 * in_dim, k0, k1, nr, nc, y + r0 * out_dim + o,
                          out_dim, &ahead);
                o += nc;
            }
        }
    }
    return o1;
}
#else
#define BF16_DOTS 0
#endif

#endif
