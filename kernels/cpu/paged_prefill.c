/* Paged prefill attention for CPUs: the query tokens of prompt chunks attend causally to their sequence's
 * keys through the block table, cached prefix included (query i of q_len sees keys j < seq_len - q_len + i + 1),
 * each key and value read in place from the pool.
 *
 * Pool layout as kernels/reference.py: k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim], fp32
 * or bf16 (each key tile's rows widened into an fp32 scratch first, kv_rows.h).
 * A work item is (sequence, KV head, tile of up to QT query positions), spread over the OpenMP threads of the
 * process (torch's libgomp). It walks the keys in tiles of KT, up to the tile's last causal key: each key tile
 * is transposed once into [head_dim][KT] and then serves every query row of the tile for all heads of the
 * GQA group, so a score row is head_dim multiply-adds of a key-tile vector (no horizontal sums), and the
 * softmax is online (running max and sum per row, accumulator rescaled when the max rises). Rows are taken
 * eight at a time: their scores as eight independent chains of multiply-adds, then their softmax updates
 * (with AVX-512 each row's tile of scores stays one vector: masked max, exponentials, sum), then their values,
 * so the reductions' latencies overlap instead of following one another; with AVX-512 a whole key tile is
 * transposed in registers, 16 x 16 at a time; with AVX2 and FMA the same steps are written out in 8-lane
 * registers (8 x 8 transposes, four rows' scores as eight chains, the softmax's exponentials in vectors):
 * the library is built -std=c11, where GCC never fuses a * b + c on its own, and the exponentials' loop
 * stayed scalar (x5.7-8.5 at head_dim 64-256 on a 2-core AVX2 VM). Elsewhere written for the compiler
 * to vectorize (-O3 -march=native).
 *
 * bf16 dot products (`bf16_dots`, a bf16 pool on a CPU with AVX512_BF16): for a model served in bf16, whose
 * prompt-chunk matmuls already multiply bf16 activations. The scaled queries and each tile's softmax weights
 * are rounded to bf16 (what flash attention does on a GPU) and both products run as `vdpbf16ps`, two
 * multiply-adds a lane into fp32: half the instructions of the fp32 path, and the pool's bf16 keys and values
 * are multiplied as they are, never widened. A key tile is transposed as 32-bit pairs of adjacent dimensions
 * (the same 16 x 16 transposes), a value tile interleaved as pairs of adjacent keys once for all its rows;
 * the running max, sums and accumulators stay fp32. Where the CPU has AMX tiles (and the OS hands them out),
 * the same item runs on them, 32 keys a tile: prefill_tiles.h.
 */
#define _GNU_SOURCE /* syscall(), for the tile permission (prefill_tiles.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedserve.h"
#include "kv_rows.h"
#include "vec_math.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PREFILL_AVX2 1 /* the same steps in 8-lane registers, written out: -std=c11 never contracts a*b+c */
#endif

#define KT 16            /* keys per tile: one vector of scores per query row */
#define QT 16            /* query positions per work item, at most */
#define ROWS 8           /* query rows computed together */
#define MAX_STATE 8192   /* floats of accumulators (and of query rows) per work item */
#define MAX_HEAD_DIM 256

/* 1 where this build multiplies a bf16 pool's prefill in bf16 dot products (bf16_dots), else 0. */
int pagedserve_prefill_bf16_dots(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

int pagedserve_prefill_limits(int32_t* out) {
    out[0] = MAX_STATE;
    out[1] = MAX_HEAD_DIM;
    return 2;
}

/* Element offset of key (or value) row j of a sequence, kv head kh, in the pool. */
static inline int64_t kv_at(const int32_t* table, int j, int block_size, int64_t block_stride, int64_t token_stride,
                            int kh, int head_dim) {
    return (int64_t)table[j / block_size] * block_stride + (int64_t)(j % block_size) * token_stride
           + (int64_t)kh * head_dim;
}

#if defined(__AVX512F__)
/* out[c][r] = rows[r][col + c] for a 16 x 16 tile: pairs, quads, then the 128-bit lanes exchanged twice. */
static inline void transpose16(const float* const rows[KT], int col, float (*out)[KT]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        const __m512 a = _mm512_loadu_ps(rows[i] + col), b = _mm512_loadu_ps(rows[i + 1] + col);
        t[i] = _mm512_unpacklo_ps(a, b); /* per 128-bit lane k: rows i, i+1 at columns 4k, 4k+1 */
        t[i + 1] = _mm512_unpackhi_ps(a, b); /* ... at columns 4k+2, 4k+3 */
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + j], lane k: rows g .. g+3 at column 4k + j */
        const __m512d t0 = _mm512_castps_pd(t[g]), t1 = _mm512_castps_pd(t[g + 1]);
        const __m512d t2 = _mm512_castps_pd(t[g + 2]), t3 = _mm512_castps_pd(t[g + 3]);
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), w = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        const __m512 w2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
        _mm512_storeu_ps(out[j], _mm512_shuffle_f32x4(v, v2, 0x88));
        _mm512_storeu_ps(out[8 + j], _mm512_shuffle_f32x4(v, v2, 0xdd));
        _mm512_storeu_ps(out[4 + j], _mm512_shuffle_f32x4(w, w2, 0x88));
        _mm512_storeu_ps(out[12 + j], _mm512_shuffle_f32x4(w, w2, 0xdd));
    }
}
#endif

/* An item's rows out: each (head g, position r) accumulator over its softmax sum, at token start + r. */
static void write_rows(float* out, const float* acc, const float* l, const float* m, const float* sinks,
                       int64_t start, int rows, int group, int kh, int n_heads, int head_dim) {
    for (int g = 0; g < group; g++) {
        const int h = kh * group + g;
        for (int r = 0; r < rows; r++) {
            const int row = g * rows + r;
            /* a sink (gpt-oss): one more logit in the row's softmax, its probability dropped */
            const float sum = sinks ? l[row] + expf(sinks[h] - m[row]) : l[row];
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            float* dst = out + ((start + r) * n_heads + h) * (int64_t)head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) dst[d] = acc[row * head_dim + d] * inv;
        }
    }
}

/* Each query row's state before its first key tile: no keys seen, and the keys it may see, the causal limit
 * (its own position) and a sliding window's first key. */
static inline void init_rows(int rows, int group, int p0, int offset, int window, int head_dim, float* acc,
                             float* m, float* l, int* limit, int* lowest) {
    for (int row = 0; row < rows * group; row++) {
        const int r = row % rows;
        for (int d = 0; d < head_dim; d++) acc[row * head_dim + d] = 0.0f;
        m[row] = -INFINITY;
        l[row] = 0.0f;
        limit[row] = offset + p0 + r;
        lowest[row] = window > 0 && limit[row] + 1 > window ? limit[row] + 1 - window : 0;
    }
}

/* The keys [from, n) of the tile at j0 (nk keys) a row sees. */
static inline void row_span(int limit, int lowest, int j0, int nk, int* from, int* n) {
    const int see = limit - j0 + 1;
    *from = lowest > j0 ? lowest - j0 : 0;
    *n = see < nk ? see : nk;
}

/* A row's running softmax after a tile whose new maximum is top and whose exponentials sum to sum: the
 * factor its accumulator is rescaled by (0 on the first tile, m = -inf; 1, with no call, while m holds). */
static inline float rescale(float top, float sum, float* m, float* l) {
    const float corr = top > *m ? expf(*m - top) : 1.0f;
    *l = *l * corr + sum;
    *m = top;
    return corr;
}

#if defined(PREFILL_AVX2)
static const float ZERO_KEY[MAX_HEAD_DIM] = {0}; /* a key or value the tile does not read */

/* out[col + c][r0 + r] = rows[r][col + c] for an 8 x 8 tile: pairs, quads, then the 128-bit halves. */
static inline void transpose8(const float* const* rows, int col, float (*out)[KT], int r0) {
    __m256 a[8], t[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(rows[i] + col);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        a[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        a[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        a[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        a[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(out[col + c] + r0, _mm256_permute2f128_ps(a[c], a[c + 4], 0x20));
        _mm256_storeu_ps(out[col + 4 + c] + r0, _mm256_permute2f128_ps(a[c], a[c + 4], 0x31));
    }
}

/* Scores of four query rows against the transposed key tile: eight independent chains (two 8-key halves a
 * row), the tile's two vectors loaded once for the four rows. */
static inline void scores4(const float* q0, int head_dim, float (*kt)[KT], float (*s)[KT]) {
    __m256 c0[4], c1[4];
    for (int i = 0; i < 4; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt[d]), k1 = _mm256_loadu_ps(kt[d] + 8);
        for (int i = 0; i < 4; i++) {
            const __m256 b = _mm256_broadcast_ss(q0 + i * head_dim + d);
            c0[i] = _mm256_fmadd_ps(b, k0, c0[i]);
            c1[i] = _mm256_fmadd_ps(b, k1, c1[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(s[i], c0[i]);
        _mm256_storeu_ps(s[i] + 8, c1[i]);
    }
}

/* tile_softmax512 on two 8-lane halves: a row's 16 scores over keys [from, n) to their exponentials in p (0
 * outside the span), the running state updated; returns its factor. */
static inline float tile_softmax256(const float* s, int from, int n, float* m, float* l, float* p) {
    const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
    const __m256i f = _mm256_set1_epi32(from - 1), e = _mm256_set1_epi32(n);
    const __m256 v0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lo, f), _mm256_cmpgt_epi32(e, lo)));
    const __m256 v1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, f), _mm256_cmpgt_epi32(e, hi)));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    __m256 mx = _mm256_max_ps(_mm256_blendv_ps(ninf, s0, v0), _mm256_blendv_ps(ninf, s1, v1));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float top_tile = _mm_cvtss_f32(h), top = top_tile > *m ? top_tile : *m;
    const __m256 t = _mm256_set1_ps(top);
    /* lanes outside the span may hold anything: their exponentials are masked to 0 */
    const __m256 p0 = _mm256_and_ps(exp256_nonpositive(_mm256_min_ps(_mm256_sub_ps(s0, t), _mm256_setzero_ps())), v0);
    const __m256 p1 = _mm256_and_ps(exp256_nonpositive(_mm256_min_ps(_mm256_sub_ps(s1, t), _mm256_setzero_ps())), v1);
    _mm256_storeu_ps(p, p0);
    _mm256_storeu_ps(p + 8, p1);
    const __m256 sum8 = _mm256_add_ps(p0, p1);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return rescale(top, _mm_cvtss_f32(q), m, l);
}

/* acc = acc * correction + sum over keys [from, n) of p[j] * value j, 64 dimensions at a time in eight
 * registers (head_dim a multiple of 8). */
static inline void values8(float* acc, const float* p, const float* const* vrows, int from, int n, float correction,
                           int head_dim) {
    const __m256 cr = _mm256_set1_ps(correction);
    int d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * u), cr);
        for (int jj = from; jj < n; jj++) {
            const __m256 pj = _mm256_broadcast_ss(p + jj);
            const float* value = vrows[jj] + d;
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(value + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, a[u]);
    }
    for (; d < head_dim; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), cr);
        for (int jj = from; jj < n; jj++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + jj), _mm256_loadu_ps(vrows[jj] + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
}
#endif

#if defined(__AVX512F__)
/* A row's tile of scores s (one vector) over keys [from, n): max, exponentials and sum without leaving the
 * vector. Returns the exponentials (0 outside the span); the running state updated, its factor in *corr. */
static inline __m512 tile_softmax512(const float* s, int from, int n, float* m, float* l, float* corr) {
    const __mmask16 valid = (__mmask16)(((1u << n) - 1u) & ~((1u << from) - 1u));
    const __m512 sv = _mm512_loadu_ps(s);
    const float top_tile = _mm512_mask_reduce_max_ps(valid, sv);
    const float top = top_tile > *m ? top_tile : *m;
    const __m512 pv = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(sv, _mm512_set1_ps(top))));
    *corr = rescale(top, _mm512_reduce_add_ps(pv), m, l);
    return pv;
}
#endif

/* One work item: query positions [p0, p1) of a sequence (positions within its q_len new tokens), one KV
 * head's group of query heads. */
static void prefill_item(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                         float* out, int64_t start, int q_len, int seq_len, const int32_t* table, int p0, int p1,
                         int kh, int n_heads, int group, int head_dim, int block_size, int64_t block_stride,
                         int64_t token_stride, float scale, int window, float softcap, const float* sinks,
                         int kv_bf16) {
    const int rows = p1 - p0;
    const int total = rows * group;                /* query rows of the item: (head g, position r) -> g * rows + r */
    float acc[MAX_STATE];                          /* [total][head_dim] */
    float qs[MAX_STATE];                           /* [total][head_dim], scaled */
    float m[QT * 16], l[QT * 16];                  /* per query row: group <= 16 */
    int limit[QT * 16];                            /* last key each row sees */
    int lowest[QT * 16];                           /* first key each row sees (a sliding window's start) */
    float kt[MAX_HEAD_DIM][KT];                    /* the key tile, transposed */
    const float* vrows[KT];
    float kwide[KT][MAX_HEAD_DIM], vwide[KT][MAX_HEAD_DIM]; /* a bf16 pool's tile rows, widened */
    const int offset = seq_len - q_len;            /* keys before the chunk (cached prefix) */
    for (int g = 0; g < group; g++) {
        const int h = kh * group + g;
        for (int r = 0; r < rows; r++) {
            const int row = g * rows + r;
            const float* src = q + (start + p0 + r) * q_row_stride + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) qs[row * head_dim + d] = src[d] * scale;
        }
    }
    init_rows(rows, group, p0, offset, window, head_dim, acc, m, l, limit, lowest);
    const int last_key = offset + p1 - 1; /* the tile's last row sees keys 0..last_key */
    const int first_key = lowest[0];      /* ... and its first row sees the earliest */
    for (int j0 = first_key - first_key % KT; j0 <= last_key; j0 += KT) {
        const int nk = last_key + 1 - j0 < KT ? last_key + 1 - j0 : KT;
        const float* krows[KT];
        for (int jj = 0; jj < KT; jj++) {
            const int seen = jj < nk && j0 + jj >= first_key; /* keys before every row's window are never read */
            krows[jj] = vrows[jj] = 0;
            if (!seen) continue;
            const int64_t at = kv_at(table, j0 + jj, block_size, block_stride, token_stride, kh, head_dim);
            if (kv_bf16) {
                kv_widen(k_cache, at, 1, kwide[jj], head_dim);
                kv_widen(v_cache, at, 1, vwide[jj], head_dim);
                krows[jj] = kwide[jj];
                vrows[jj] = vwide[jj];
            } else {
                krows[jj] = (const float*)k_cache + at;
                vrows[jj] = (const float*)v_cache + at;
            }
        }
#if defined(__AVX512F__)
        if (nk == KT && j0 >= first_key && head_dim % 16 == 0) /* a whole tile: 16 x 16 transposes in registers */
            for (int d = 0; d < head_dim; d += 16) transpose16(krows, d, &kt[d]);
        else
#elif defined(PREFILL_AVX2)
        if (head_dim % 8 == 0) { /* keys the tile does not read as zero rows, 8 x 8 transposes in registers */
            for (int jj = 0; jj < KT; jj++) {
                if (!krows[jj]) krows[jj] = ZERO_KEY;
                if (!vrows[jj]) vrows[jj] = ZERO_KEY;
            }
            for (int d = 0; d < head_dim; d += 8) {
                transpose8(krows, d, kt, 0);
                transpose8(krows + 8, d, kt, 8);
            }
        } else
#endif
        for (int jj = 0; jj < KT; jj++)
            for (int d = 0; d < head_dim; d++) kt[d][jj] = krows[jj] ? krows[jj][d] : 0.0f;
        for (int row0 = 0; row0 < total; row0 += ROWS) {
            float s[ROWS][KT];
            const int nr = total - row0 < ROWS ? total - row0 : ROWS;
            for (int i = 0; i < ROWS; i++)
#pragma omp simd
                for (int jj = 0; jj < KT; jj++) s[i][jj] = 0.0f;
#if defined(__AVX512F__)
            if (nr == ROWS) { /* eight independent chains of multiply-adds, the key tile's vector loaded once */
                const float* q0 = qs + (int64_t)row0 * head_dim;
                __m512 c[ROWS];
                for (int i = 0; i < ROWS; i++) c[i] = _mm512_setzero_ps();
                for (int d = 0; d < head_dim; d++) {
                    const __m512 kd = _mm512_loadu_ps(kt[d]);
                    for (int i = 0; i < ROWS; i++) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(q0[i * head_dim + d]), kd, c[i]);
                }
                for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(s[i], c[i]);
            } else
            for (int i = 0; i < nr; i++) {
#elif defined(PREFILL_AVX2)
            int done = 0;
            for (; done + 4 <= nr; done += 4) scores4(qs + (int64_t)(row0 + done) * head_dim, head_dim, kt, s + done);
            for (int i = done; i < nr; i++) {
#else
            for (int i = 0; i < nr; i++) {
#endif
                const float* qi = qs + (int64_t)(row0 + i) * head_dim;
                for (int d = 0; d < head_dim; d++)
#pragma omp simd
                    for (int jj = 0; jj < KT; jj++) s[i][jj] += qi[d] * kt[d][jj];
            }
            if (softcap > 0.0f) soft_cap(&s[0][0], ROWS * KT, softcap);
            /* the rows' softmax updates first, then their values: eight independent chains of reductions and
               exponentials in flight together, not one row's latency after another's */
            float p[ROWS][KT], corr[ROWS];
            int from_of[ROWS], n_of[ROWS];
            for (int i = 0; i < nr; i++) {
                const int row = row0 + i;
                int from, n;
                row_span(limit[row], lowest[row], j0, nk, &from, &n);
                from_of[i] = from;
                n_of[i] = n;
                if (n <= from) continue;
#if defined(__AVX512F__)
                _mm512_storeu_ps(p[i], tile_softmax512(s[i], from, n, &m[row], &l[row], &corr[i]));
#elif defined(PREFILL_AVX2)
                corr[i] = tile_softmax256(s[i], from, n, &m[row], &l[row], p[i]);
#else
                float top = m[row], sum = 0.0f;
                for (int jj = from; jj < n; jj++) top = s[i][jj] > top ? s[i][jj] : top;
#pragma omp simd reduction(+ : sum)
                for (int jj = 0; jj < KT; jj++) {
                    p[i][jj] = jj >= from && jj < n ? vec_exp(s[i][jj] - top) : 0.0f;
                    sum += p[i][jj];
                }
                corr[i] = rescale(top, sum, &m[row], &l[row]);
#endif
            }
            for (int i = 0; i < nr; i++) {
                const int from = from_of[i], n = n_of[i];
                if (n <= from) continue;
                const float correction = corr[i];
                const float* pr = p[i];
                float* a = acc + (int64_t)(row0 + i) * head_dim;
#if defined(__AVX512F__)
                if (head_dim % 64 == 0) { /* four accumulator vectors in registers over the tile's values */
                    const __m512 cr = _mm512_set1_ps(correction);
                    for (int d = 0; d < head_dim; d += 64) {
                        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a + d), cr);
                        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 16), cr);
                        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 32), cr);
                        __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 48), cr);
                        for (int jj = from; jj < n; jj++) {
                            const __m512 pj = _mm512_set1_ps(pr[jj]);
                            const float* value = vrows[jj] + d;
                            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(value), a0);
                            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(value + 16), a1);
                            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(value + 32), a2);
                            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(value + 48), a3);
                        }
                        _mm512_storeu_ps(a + d, a0);
                        _mm512_storeu_ps(a + d + 16, a1);
                        _mm512_storeu_ps(a + d + 32, a2);
                        _mm512_storeu_ps(a + d + 48, a3);
                    }
                    continue;
                }
#elif defined(PREFILL_AVX2)
                if (head_dim % 8 == 0) {
                    values8(a, pr, vrows, from, n, correction, head_dim);
                    continue;
                }
#endif
                if (correction != 1.0f)
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] *= correction;
                for (int jj = from; jj < n; jj++) {
                    const float pj = pr[jj];
                    const float* value = vrows[jj];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] += pj * value[d];
                }
            }
        }
    }
    write_rows(out, acc, l, m, sinks, start + p0, rows, group, kh, n_heads, head_dim);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PREFILL_BF16 1
static const uint16_t ZERO_ROW[MAX_HEAD_DIM] = {0}; /* a key or value the tile does not read */

/* prefill_item on a bf16 pool in bf16 dot products (head_dim a multiple of 32): see the top of this file. */
static void prefill_item_bf16(const float* q, int64_t q_row_stride, const uint16_t* k_cache,
                              const uint16_t* v_cache, float* out, int64_t start, int q_len, int seq_len,
                              const int32_t* table, int p0, int p1, int kh, int n_heads, int group, int head_dim,
                              int block_size, int64_t block_stride, int64_t token_stride, float scale, int window,
                              float softcap, const float* sinks) {
    const int rows = p1 - p0, total = rows * group, hp = head_dim / 2;
    float acc[MAX_STATE];                    /* [total][head_dim] */
    uint32_t qp[MAX_STATE / 2];              /* [total][head_dim / 2]: the scaled query as bf16 pairs */
    float m[QT * 16], l[QT * 16];
    int limit[QT * 16], lowest[QT * 16];
    uint32_t kt[MAX_HEAD_DIM / 2][KT];       /* kt[dp][j] = key j's dimensions 2 dp, 2 dp + 1 */
    uint32_t vt[KT / 2][MAX_HEAD_DIM];       /* vt[kp][d] = dimension d of keys 2 kp, 2 kp + 1 */
    const int offset = seq_len - q_len;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < group; g++) {
        const int h = kh * group + g;
        for (int r = 0; r < rows; r++) {
            const int row = g * rows + r;
            const float* src = q + (start + p0 + r) * q_row_stride + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d += 32) {
                const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(src + d), sc);
                const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), sc);
                _mm512_storeu_si512((void*)(qp + row * hp + d / 2), (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
        }
    }
    init_rows(rows, group, p0, offset, window, head_dim, acc, m, l, limit, lowest);
    const int last_key = offset + p1 - 1, first_key = lowest[0];
    for (int j0 = first_key - first_key % KT; j0 <= last_key; j0 += KT) {
        const int nk = last_key + 1 - j0 < KT ? last_key + 1 - j0 : KT;
        const float* krows[KT]; /* the rows as 32-bit words (bf16 pairs), for the transposes */
        const uint16_t* vrows[KT];
        for (int jj = 0; jj < KT; jj++) {
            const int seen = jj < nk && j0 + jj >= first_key;
            const int64_t at = seen ? kv_at(table, j0 + jj, block_size, block_stride, token_stride, kh, head_dim) : 0;
            krows[jj] = (const float*)(seen ? k_cache + at : ZERO_ROW);
            vrows[jj] = seen ? v_cache + at : ZERO_ROW;
        }
        for (int dp = 0; dp < hp; dp += 16) transpose16(krows, dp, (float(*)[KT])&kt[dp]);
        for (int kp = 0; kp < KT / 2; kp++)
            for (int d = 0; d < head_dim; d += 16) {
                const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrows[2 * kp] + d)));
                const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrows[2 * kp + 1] + d)));
                _mm512_storeu_si512((void*)(vt[kp] + d), _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        for (int row0 = 0; row0 < total; row0 += ROWS) {
            const int nr = total - row0 < ROWS ? total - row0 : ROWS;
            __m512 c[ROWS];
            for (int i = 0; i < ROWS; i++) c[i] = _mm512_setzero_ps();
            const uint32_t* q0 = qp + (int64_t)row0 * hp;
            if (nr == ROWS) { /* eight independent chains, the key tile's pairs loaded once */
                for (int dp = 0; dp < hp; dp++) {
                    const __m512bh kd = (__m512bh)_mm512_loadu_si512((const void*)kt[dp]);
                    for (int i = 0; i < ROWS; i++)
                        c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32((int)q0[i * hp + dp]), kd);
                }
            } else {
                for (int i = 0; i < nr; i++)
                    for (int dp = 0; dp < hp; dp++)
                        c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32((int)q0[i * hp + dp]),
                                                (__m512bh)_mm512_loadu_si512((const void*)kt[dp]));
            }
            float s[ROWS][KT];
            for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(s[i], c[i]);
            if (softcap > 0.0f) soft_cap(&s[0][0], ROWS * KT, softcap);
            uint32_t pp[ROWS][KT / 2]; /* each row's weights of the tile as bf16 pairs of adjacent keys */
            float corr[ROWS];
            int from_of[ROWS], n_of[ROWS];
            for (int i = 0; i < nr; i++) {
                const int row = row0 + i;
                int from, n;
                row_span(limit[row], lowest[row], j0, nk, &from, &n);
                from_of[i] = from;
                n_of[i] = n;
                if (n <= from) continue;
                const __m512 pv = tile_softmax512(s[i], from, n, &m[row], &l[row], &corr[i]);
                _mm256_storeu_si256((__m256i*)pp[i], (__m256i)_mm512_cvtneps_pbh(pv));
            }
            for (int i = 0; i < nr; i++) {
                const int from = from_of[i], n = n_of[i];
                if (n <= from) continue;
                const int kp0 = from / 2, kp1 = (n + 1) / 2; /* pairs holding a key the row sees */
                const __m512 cr = _mm512_set1_ps(corr[i]);
                float* a = acc + (int64_t)(row0 + i) * head_dim;
                int d = 0;
                for (; d + 64 <= head_dim; d += 64) { /* four accumulators in registers over the tile */
                    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a + d), cr);
                    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 16), cr);
                    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 32), cr);
                    __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 48), cr);
                    for (int kp = kp0; kp < kp1; kp++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[i][kp]);
                        const uint32_t* v = vt[kp] + d;
                        a0 = _mm512_dpbf16_ps(a0, w, (__m512bh)_mm512_loadu_si512((const void*)v));
                        a1 = _mm512_dpbf16_ps(a1, w, (__m512bh)_mm512_loadu_si512((const void*)(v + 16)));
                        a2 = _mm512_dpbf16_ps(a2, w, (__m512bh)_mm512_loadu_si512((const void*)(v + 32)));
                        a3 = _mm512_dpbf16_ps(a3, w, (__m512bh)_mm512_loadu_si512((const void*)(v + 48)));
                    }
                    _mm512_storeu_ps(a + d, a0);
                    _mm512_storeu_ps(a + d + 16, a1);
                    _mm512_storeu_ps(a + d + 32, a2);
                    _mm512_storeu_ps(a + d + 48, a3);
                }
                for (; d < head_dim; d += 16) {
                    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a + d), cr);
                    for (int kp = kp0; kp < kp1; kp++)
                        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32((int)pp[i][kp]),
                                              (__m512bh)_mm512_loadu_si512((const void*)(vt[kp] + d)));
                    _mm512_storeu_ps(a + d, a0);
                }
            }
        }
    }
    write_rows(out, acc, l, m, sinks, start + p0, rows, group, kh, n_heads, head_dim);
}
#endif

#include "prefill_tiles.h"

/* Whether prompt attention over a bf16 pool runs on AMX tiles; use >= 0 sets it (0: the vector item). */
int pagedserve_prefill_tiles(int32_t use) {
#if defined(PREFILL_TILES)
    if (use >= 0) tiles_wanted = use != 0;
    return tiles_ready();
#else
    (void)use;
    return 0;
#endif
}

/* Query rows [start, start + q_len) of one sequence, one KV head's group of query heads, in tiles of what an
 * item holds: the rows of a drafting sequence in a decode step (decode_step.c), whose keys are then read once
 * for all of them rather than once a row. Arguments as pagedserve_paged_prefill's, for that one sequence. */
void pagedserve_prefill_rows(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                             float* out, int64_t start, int32_t q_len, int32_t seq_len, const int32_t* table,
                             int32_t kh, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                             float scale, int32_t window, float softcap, const float* sinks, int32_t kv_bf16) {
    const int group = n_heads / n_kv_heads;
    const int64_t token_stride = (int64_t)n_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    int qt = MAX_STATE / (group * head_dim);
    if (qt > QT) qt = QT;
    for (int p0 = 0; p0 < q_len; p0 += qt) {
        const int p1 = p0 + qt < q_len ? p0 + qt : q_len;
        prefill_item(q, q_row_stride, k_cache, v_cache, out, start, q_len, seq_len, table, p0, p1, kh, n_heads,
                     group, head_dim, block_size, block_stride, token_stride, scale, window, softcap, sinks, kv_bf16);
    }
}

void pagedserve_paged_prefill(
    const float* q,              /* query rows: token t's heads at q + t * q_row_stride, [n_heads, head_dim] */
    int64_t q_row_stride,
    const void* k_cache,         /* [num_blocks, block_size, n_kv_heads, head_dim], fp32 or bf16 (kv_bf16) */
    const void* v_cache,
    float* out,                  /* [num_tokens, n_heads, head_dim]; only the sequences' rows are written */
    const int64_t* starts,       /* [n]: first query token of each sequence in the step */
    const int32_t* q_lens,       /* [n]: its query tokens (the last q_len positions of its keys) */
    const int32_t* seq_lens,     /* [n]: its keys, this step's included */
    const int32_t* block_tables, /* [n, table_stride] */
    int64_t table_stride, int32_t n, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
    float scale,
    int32_t window,              /* > 0: each query sees only its last `window` keys (itself included) */
    float softcap,               /* > 0: each scaled score s is softcap * tanh(s / softcap) (Gemma 2) */
    int32_t kv_bf16,             /* the pool holds bf16 */
    int32_t bf16_dots,           /* with a bf16 pool: queries and weights rounded to bf16, bf16 dot products
                                    (where pagedserve_prefill_bf16_dots() says this build has them) */
    const float* sinks)          /* [n_heads] or NULL: one more logit per head in each softmax (gpt-oss) */
{
    const int group = n_heads / n_kv_heads;
    const int64_t token_stride = (int64_t)n_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    int qt = MAX_STATE / (group * head_dim);
    if (qt > QT) qt = QT;
    int64_t tiles = 0;
    for (int i = 0; i < n; i++) tiles += (q_lens[i] + qt - 1) / qt;
    int32_t* items = malloc(sizeof(int32_t) * 2 * (tiles > 0 ? tiles : 1)); /* (sequence, first position) */
    if (items == 0) return;
    int64_t k = 0;
    for (int i = 0; i < n; i++)
        for (int p = 0; p < q_lens[i]; p += qt) {
            items[2 * k] = i;
            items[2 * k + 1] = p;
            k++;
        }
#if defined(PREFILL_TILES)
    const int on_tiles = bf16_dots && kv_bf16 && head_dim % 32 == 0 && tiles_ready();
#endif
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles; it++) {
        for (int kh = 0; kh < n_kv_heads; kh++) {
            const int i = items[2 * it], p0 = items[2 * it + 1];
            const int p1 = p0 + qt < q_lens[i] ? p0 + qt : q_lens[i];
#if defined(PREFILL_TILES)
            if (on_tiles) {
                prefill_item_tiles(q, q_row_stride, (const uint16_t*)k_cache, (const uint16_t*)v_cache, out,
                                   starts[i], q_lens[i], seq_lens[i], block_tables + (int64_t)i * table_stride, p0,
                                   p1, kh, n_heads, group, head_dim, block_size, block_stride, token_stride, scale,
                                   window, softcap, sinks);
                continue;
            }
#endif
#if defined(PREFILL_BF16)
            if (bf16_dots && kv_bf16 && head_dim % 32 == 0) {
                prefill_item_bf16(q, q_row_stride, (const uint16_t*)k_cache, (const uint16_t*)v_cache, out, starts[i],
                                  q_lens[i], seq_lens[i], block_tables + (int64_t)i * table_stride, p0, p1, kh, n_heads,
                                  group, head_dim, block_size, block_stride, token_stride, scale, window, softcap,
                                  sinks);
                continue;
            }
#endif
            prefill_item(q, q_row_stride, k_cache, v_cache, out, starts[i], q_lens[i], seq_lens[i],
                         block_tables + (int64_t)i * table_stride, p0, p1, kh, n_heads, group, head_dim, block_size,
                         block_stride, token_stride, scale, window, softcap, sinks, kv_bf16);
        }
    }
    free(items);
}
