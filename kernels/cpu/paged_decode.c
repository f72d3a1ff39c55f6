/* Paged decode attention for CPUs: one query token per sequence, attending in place through the block
 * table (no gathered copy of the keys), all query heads of a GQA group sharing each key and value read.
 *
 * Pool layout as kernels/reference.py: k_cache, v_cache are [num_blocks, block_size, n_kv_heads, head_dim]
 * fp32 or bf16 (kv_rows.h: sixteen keys at a time widened into L1), contiguous. A work item is a sequence
 * with all its KV heads (or as many as an item's state holds) — with few sequences, a block-aligned range of
 * one's keys, the ranges' softmax states merged after (pagedserve_decode_splits) —
 * spread over the OpenMP threads of the process (the same libgomp runtime torch uses, so the two share one
 * thread pool): it walks the sequence's blocks once, each block's rows read in one pass, and asks for the
 * next block before computing the current one, since blocks lie anywhere in the pool. Per block and GQA
 * group: the scores of the group's heads, then an online softmax update (running max and sum, accumulator
 * rescaled when the max rises), so every key and value is read exactly once. On AVX-512 a block's sixteen
 * dot products are summed together by a transposing tree (sum16), the query of a 64- or 128-wide head stays
 * in registers, and up to three heads of a group take each value row at once. Built by kernels/cpu_native.py
 * with -O3 -march=native; the inner loops over head_dim are written for the compiler to vectorize.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedserve.h"
#include "kv_rows.h"
#include "vec_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define BLOCK_AVX2 1 /* block_scores_avx2 and add_values: an AVX2 build's */
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define LANES 16
#define MAX_SPLITS 8 /* key ranges of one sequence (pagedserve_decode_splits) */
#define MAX_STATE 8192 /* floats of query (and of accumulator) state per work item: >= MAX_GROUP * MAX_HEAD_DIM */

/* Dot product over head_dim in LANES independent partial sums (one vector register), summed once. */
static inline float dot(const float* a, const float* b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    float s = 0.0f;
    for (; d < n; d++) s += a[d] * b[d];
    for (int width = LANES / 2; width > 0; width /= 2) /* a tree: log2(LANES) vector adds, not LANES scalar ones */
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    return s + part[0];
}

/* prefetch_rows: ask the cache for `count` rows of `width` floats, `stride` apart: keys (or values) of the
 * block a work item reads next. Blocks lie anywhere in the pool, so the hardware prefetcher cannot see the
 * next one coming. Asked for a head's rows at a time while the current block is computed, the kernel took a
 * third less time than with no prefetch on a 2-core AVX-512 machine at the workload's shapes; asking for a
 * whole block at once was slower than not asking (docs/BENCHMARKS.md): a burst of requests fills the core's
 * line fill buffers and the next request waits there (half the kernel's samples sat on prefetch
 * instructions). The AVX-512 path now asks for one key's key and value rows between that key's
 * multiply-adds, 5% faster again at 64 sequences. */
#define prefetch_rows(base, stride, count, width)                                                          \
    do { /* a macro: GCC's pure/const analysis deletes calls to a function that only prefetches */          \
        const float* pf_base = (base);                                                                       \
        if (pf_base != 0)                                                                                    \
            for (int pf_t = 0; pf_t < (count); pf_t++)                                                        \
                for (int pf_d = 0; pf_d < (width); pf_d += 16)                                                \
                    __builtin_prefetch(pf_base + pf_t * (stride) + pf_d, 0, 3);                               \
    } while (0)

#if defined(__AVX512F__)
/* sum16: lane t of the result is the sum of v[t]'s sixteen lanes. A transposing tree (pairs of rows, then
 * pairs of pairs, then 128-bit quarters) takes 45 instructions for the sixteen sums where a horizontal
 * reduction each takes ~130, and leaves the scores in one register in key order. */
static inline __m512 sum16(const __m512* v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per quarter: [x0+x2, y0+y2, x1+x3, y1+y3] of rows x = v[2i], y = v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per quarter: rows 4i..4i+3, each summed over the quarter's four lanes */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* the four quarters of each b summed, b[i]'s total landing in quarter i */
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

/* acc[h] = acc[h] * correction[h] + sum over the block's keys t of p[h][t] * value[t], for `heads` query
 * heads at once over 64 dimensions from d: each value vector loaded once for them all, and 4 x heads
 * independent multiply-add chains (a chain per head would wait on its own latency). */
static inline __attribute__((always_inline)) void values64(int heads, const float* vb, int64_t token_stride,
                                                           int count, int d, float (*p)[LANES], const float* corr,
                                                           float* acc, int head_dim) {
    __m512 a[3][4];
    for (int h = 0; h < heads; h++) {
        const __m512 c = _mm512_set1_ps(corr[h]);
        for (int j = 0; j < 4; j++) a[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * head_dim + d + j * LANES), c);
    }
    for (int t = 0; t < count; t++) {
        const float* value = vb + t * token_stride + d;
        const __m512 v0 = _mm512_loadu_ps(value), v1 = _mm512_loadu_ps(value + LANES);
        const __m512 v2 = _mm512_loadu_ps(value + 2 * LANES), v3 = _mm512_loadu_ps(value + 3 * LANES);
        for (int h = 0; h < heads; h++) {
            const __m512 pt = _mm512_set1_ps(p[h][t]);
            a[h][0] = _mm512_fmadd_ps(pt, v0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(pt, v1, a[h][1]);
            a[h][2] = _mm512_fmadd_ps(pt, v2, a[h][2]);
            a[h][3] = _mm512_fmadd_ps(pt, v3, a[h][3]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + h * head_dim + d + j * LANES, a[h][j]);
}

/* One key's dot product with a query held in nv registers (nv = head_dim / 16, a constant where inlined):
 * two multiply-add chains, so the sum waits on half as many latencies. */
static inline __attribute__((always_inline)) __m512 key_dot(const __m512* q, const float* key, int nv) {
    __m512 a0 = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
    __m512 a1 = _mm512_mul_ps(q[1], _mm512_loadu_ps(key + LANES));
    for (int j = 2; j < nv; j += 2) {
        a0 = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(key + j * LANES), a0);
        a1 = _mm512_fmadd_ps(q[j + 1], _mm512_loadu_ps(key + (j + 1) * LANES), a1);
    }
    return _mm512_add_ps(a0, a1);
}

/* The sixteen partial-sum vectors of a block's keys against one query head (zeros past count), asking
 * for the next block's key and value rows of the first `pf` keys, one key's at a time. nv: head_dim / 16
 * where that is 4 or 8 (the query kept in registers, the loop unrolled), else 0 (any multiple of 16). */
static inline __attribute__((always_inline)) void score_parts(const float* qg, const float* kb, int64_t token_stride,
                                                              int count, int nv, int head_dim, int pf,
                                                              const float* kn, const float* vn, __m512* part) {
    __m512 q[8];
    for (int j = 0; j < nv; j++) q[j] = _mm512_loadu_ps(qg + j * LANES);
    for (int t = 0; t < LANES; t++) {
        if (t >= count) {
            part[t] = _mm512_setzero_ps();
            continue;
        }
        if (t < pf) {
            prefetch_rows(kn + t * token_stride, 0, 1, head_dim);
            prefetch_rows(vn + t * token_stride, 0, 1, head_dim);
        }
        const float* key = kb + t * token_stride;
        if (nv) {
            part[t] = key_dot(q, key, nv);
        } else {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(key));
            for (int d = LANES; d < head_dim; d += LANES)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(key + d), a);
            part[t] = a;
        }
    }
}

/* One block of keys for one GQA group: scores, online-softmax update, values accumulated. */
static void block_avx512(const float* qs, const float* kb, const float* vb, int64_t token_stride, int count,
                         int group, int head_dim, float* m, float* l, float* acc, const float* kn, const float* vn,
                         int next_count, float softcap) {
    float scores[MAX_GROUP][LANES];
    float correction[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        const float* qg = qs + g * head_dim;
        const int pf = g == 0 && kn ? next_count : 0; /* the first head asks for the next block */
        __m512 part[LANES]; /* per key: its dot product's sixteen partial sums */
        if (head_dim == 4 * LANES)
            score_parts(qg, kb, token_stride, count, 4, head_dim, pf, kn, vn, part);
        else if (head_dim == 8 * LANES)
            score_parts(qg, kb, token_stride, count, 8, head_dim, pf, kn, vn, part);
        else
            score_parts(qg, kb, token_stride, count, 0, head_dim, pf, kn, vn, part);
        _mm512_storeu_ps(scores[g], sum16(part));
    }
    if (softcap > 0.0f) soft_cap(&scores[0][0], group * LANES, softcap);
    const __mmask16 valid = (__mmask16)((1u << count) - 1u);
    for (int g = 0; g < group; g++) {
        const __m512 s = _mm512_maskz_loadu_ps(valid, scores[g]);
        const float top_block = _mm512_mask_reduce_max_ps(valid, s);
        const float top = top_block > m[g] ? top_block : m[g];
        correction[g] = top > m[g] ? expf(m[g] - top) : 1.0f; /* 0 on the first block: m = -inf */
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
        l[g] = l[g] * correction[g] + _mm512_reduce_add_ps(p);
        m[g] = top;
        _mm512_storeu_ps(scores[g], p);
    }
    int d = 0;
    for (; d + 4 * LANES <= head_dim; d += 4 * LANES) { /* the group's heads three at a time */
        int g = 0;
        for (; g + 3 <= group; g += 3)
            values64(3, vb, token_stride, count, d, scores + g, correction + g, acc + g * head_dim, head_dim);
        if (group - g == 2)
            values64(2, vb, token_stride, count, d, scores + g, correction + g, acc + g * head_dim, head_dim);
        else if (group - g == 1)
            values64(1, vb, token_stride, count, d, scores + g, correction + g, acc + g * head_dim, head_dim);
    }
    for (; d < head_dim; d += LANES) { /* head_dim's last sixteens past a multiple of 64 */
        for (int g = 0; g < group; g++) {
            float* ag = acc + g * head_dim;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ag + d), _mm512_set1_ps(correction[g]));
            for (int t = 0; t < count; t++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][t]), _mm512_loadu_ps(vb + t * token_stride + d), a);
            _mm512_storeu_ps(ag + d, a);
        }
    }
}
#endif

/* ag[d] += sum over the block's keys t of p[t] * value_t[d]. On AVX2 (head_dim a multiple of 8) 32 dimensions
   at a time in four registers held across the keys, where the vectorized loop over d loaded and stored the
   accumulator for every key. */
static inline void add_values(float* ag, const float* p, const float* vb, int64_t token_stride, int count,
                              int head_dim) {
#if defined(BLOCK_AVX2)
    if (head_dim % 8 == 0) {
        int d = 0;
        for (; d + 32 <= head_dim; d += 32) {
            __m256 a0 = _mm256_loadu_ps(ag + d), a1 = _mm256_loadu_ps(ag + d + 8);
            __m256 a2 = _mm256_loadu_ps(ag + d + 16), a3 = _mm256_loadu_ps(ag + d + 24);
            for (int t = 0; t < count; t++) {
                const float* value = vb + t * token_stride + d;
                const __m256 pt = _mm256_set1_ps(p[t]);
                a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value), a0);
                a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value + 8), a1);
                a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value + 16), a2);
                a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value + 24), a3);
            }
            _mm256_storeu_ps(ag + d, a0);
            _mm256_storeu_ps(ag + d + 8, a1);
            _mm256_storeu_ps(ag + d + 16, a2);
            _mm256_storeu_ps(ag + d + 24, a3);
        }
        for (; d < head_dim; d += 8) {
            __m256 a = _mm256_loadu_ps(ag + d);
            for (int t = 0; t < count; t++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vb + t * token_stride + d), a);
            _mm256_storeu_ps(ag + d, a);
        }
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float pt = p[t];
        const float* value = vb + t * token_stride;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) ag[d] += pt * value[d];
    }
}

/* A block's scores (scores[g * MAX_BLOCK + t]: head g, key t) -> the online-softmax update of each head's max
   and sum, and its values accumulated. */
static void block_update(float* scores, const float* vb, int64_t token_stride, int count, int group, int head_dim,
                         float* m, float* l, float* acc, float softcap) {
    if (softcap > 0.0f) soft_cap(scores, group * MAX_BLOCK, softcap);
    for (int g = 0; g < group; g++) {
        float* sg = scores + g * MAX_BLOCK;
        float top = m[g];
        for (int t = 0; t < count; t++) top = sg[t] > top ? sg[t] : top;
        const float correction = expf(m[g] - top); /* 0 on the first block: m = -inf */
        float* ag = acc + g * head_dim;
        if (correction != 1.0f) {
            l[g] *= correction;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) ag[d] *= correction;
        }
        m[g] = top;
        float sum = 0.0f;
#if defined(BLOCK_AVX2)
        /* eight scores at a time (the -std=c11 build left vec_exp's loop scalar: a third of a one-stream
           step's attention); the tail's lanes past count are computed on the block's padding and not summed */
        __m256 vs = _mm256_setzero_ps();
        for (int t = 0; t < count; t += 8) {
            const __m256 e = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sg + t, e);
            const int n = count - t;
            vs = _mm256_add_ps(vs, n >= 8 ? e : _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                                                   _mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
        }
        {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        }
#else
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < count; t++) {
            sg[t] = vec_exp(sg[t] - top);
            sum += sg[t];
        }
#endif
        l[g] += sum;
        add_values(ag, sg, vb, token_stride, count, head_dim);
    }
}

/* The scores of a block's keys against each query head of the group: scores[g * MAX_BLOCK + t]. */
static void block_scores(const float* qs, const float* kb, int64_t token_stride, int count, int group,
                         int head_dim, float* scores) {
    for (int t = 0; t < count; t++) {
        const float* key = kb + t * token_stride;
        for (int g = 0; g < group; g++) scores[g * MAX_BLOCK + t] = dot(qs + g * head_dim, key, head_dim);
    }
}

#if defined(BLOCK_AVX2)
/* sum8: lane t of the result is the sum of v[t]'s eight lanes (a transposing tree, as sum16 on AVX-512): the
 * eight keys' scores in one register where eight horizontal reductions took three times the instructions. */
static inline __m256 sum8(const __m256* v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* per 128-bit half: keys 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* block_scores on AVX2 (head_dim a multiple of 8): each key's dot product in two multiply-add chains, eight
 * keys' summed together by sum8. */
static void block_scores_avx2(const float* qs, const float* kb, int64_t token_stride, int count, int group,
                              int head_dim, float* scores) {
    for (int g = 0; g < group; g++) {
        const float* qg = qs + g * head_dim;
        for (int t0 = 0; t0 < count; t0 += 8) { /* MAX_BLOCK is a multiple of 8: the last store stays inside */
            __m256 part[8];
            for (int t = 0; t < 8; t++) {
                if (t0 + t >= count) {
                    part[t] = _mm256_setzero_ps();
                    continue;
                }
                const float* key = kb + (t0 + t) * token_stride;
                __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(key)), a1 = _mm256_setzero_ps();
                int d = 8;
                for (; d + 16 <= head_dim; d += 16) {
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(key + d), a1);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(key + d + 8), a0);
                }
                if (d < head_dim) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(key + d), a1);
                part[t] = _mm256_add_ps(a0, a1);
            }
            _mm256_storeu_ps(scores + g * MAX_BLOCK + t0, sum8(part));
        }
    }
}
#endif

/* One block of keys for one GQA group without AVX-512: scores (AVX2's where head_dim allows, else the
 * portable loops), online-softmax update, values. */
static void block_no512(const float* qs, const float* kb, const float* vb, int64_t token_stride, int count,
                        int group, int head_dim, float* m, float* l, float* acc, const float* kn, const float* vn,
                        int next_count, float softcap) {
    float scores[MAX_GROUP * MAX_BLOCK];
    prefetch_rows(kn, token_stride, next_count, head_dim);
    prefetch_rows(vn, token_stride, next_count, head_dim);
#if defined(BLOCK_AVX2)
    if (head_dim % 8 == 0)
        block_scores_avx2(qs, kb, token_stride, count, group, head_dim, scores);
    else
#endif
        block_scores(qs, kb, token_stride, count, group, head_dim, scores);
    block_update(scores, vb, token_stride, count, group, head_dim, m, l, acc, softcap);
}

int pagedserve_decode_limits(int32_t* out) {
    out[0] = MAX_GROUP;
    out[1] = MAX_HEAD_DIM;
    out[2] = MAX_BLOCK;
    return 3;
}

/* The state of one work item: the query heads of KV heads [kh0, kh1) of one query token (q_row: its n_heads *
 * head_dim values) over keys [first, len) of the sequence through its block table: per query head its
 * unnormalized accumulator (acc, head_dim values a head), running max m and sum l. */
void pagedserve_decode_part(const float* q_row, const void* k_cache, const void* v_cache, const int32_t* table,
                            int32_t first, int32_t len, int kh0, int kh1, int32_t n_heads, int32_t n_kv_heads,
                            int32_t head_dim, int32_t block_size, float scale, float softcap, int kv_bf16, float* acc,
                            float* m, float* l) {
    const int group = n_heads / n_kv_heads;
    const int64_t token_stride = (int64_t)n_kv_heads * head_dim; /* between consecutive keys of a block */
    const int64_t block_stride = (int64_t)block_size * token_stride;
    float qs[MAX_STATE];
    const int item_heads = (kh1 - kh0) * group; /* query heads of the item, consecutive in q */
    const int64_t head0 = (int64_t)kh0 * group;
    const float* qp = q_row + head0 * head_dim;
    for (int h = 0; h < item_heads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            qs[h * head_dim + d] = qp[h * head_dim + d] * scale;
            acc[h * head_dim + d] = 0.0f;
        }
    }
    for (int start = first - first % block_size; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int skip = start < first ? first - start : 0; /* keys of the first block before the window */
        const int count = (len - start < block_size ? len - start : block_size) - skip;
        const int rest = len - start - block_size; /* keys after this block */
        const int next_count = rest < block_size ? (rest > 0 ? rest : 0) : block_size;
        const int64_t next = rest > 0 ? (int64_t)table[start / block_size + 1] * block_stride : 0;
        for (int kh = kh0; kh < kh1; kh++) {
            const int64_t at = block * block_stride + skip * token_stride + (int64_t)kh * head_dim;
            const int h = (kh - kh0) * group;
            float* qs_h = qs + h * head_dim;
            float* acc_h = acc + h * head_dim;
            if (kv_bf16) { /* sixteen keys at a time widened into L1, the next block's rows asked for meanwhile */
                float kw[LANES * MAX_HEAD_DIM], vw[LANES * MAX_HEAD_DIM];
                for (int sub = 0; sub < count; sub += LANES) {
                    const int c = count - sub < LANES ? count - sub : LANES;
                    for (int t = 0; t < c; t++) {
                        kv_widen(k_cache, at + (sub + t) * token_stride, 1, kw + t * head_dim, head_dim);
                        kv_widen(v_cache, at + (sub + t) * token_stride, 1, vw + t * head_dim, head_dim);
                        if (sub + t < next_count) {
                            const int64_t nat = next + (sub + t) * token_stride + (int64_t)kh * head_dim;
                            kv_prefetch(k_cache, nat, 1, head_dim);
                            kv_prefetch(v_cache, nat, 1, head_dim);
                        }
                    }
#if defined(__AVX512F__)
                    if (head_dim % LANES == 0) {
                        block_avx512(qs_h, kw, vw, head_dim, c, group, head_dim, m + h, l + h, acc_h, 0, 0, 0,
                                     softcap);
                        continue;
                    }
#endif
                    block_no512(qs_h, kw, vw, head_dim, c, group, head_dim, m + h, l + h, acc_h, 0, 0, 0, softcap);
                }
                continue;
            }
            const float* kb = (const float*)k_cache + at;
            const float* vb = (const float*)v_cache + at;
            const float* kn = rest > 0 ? (const float*)k_cache + next + (int64_t)kh * head_dim : 0; /* the next */
            const float* vn = rest > 0 ? (const float*)v_cache + next + (int64_t)kh * head_dim : 0; /* block */
#if defined(__AVX512F__)
            if (head_dim % LANES == 0) {
                for (int sub = 0; sub < count; sub += LANES) { /* blocks larger than 16 in slices of 16 */
                    const int c = count - sub < LANES ? count - sub : LANES;
                    const int first = sub == 0; /* the next block is asked for once */
                    block_avx512(qs_h, kb + sub * token_stride, vb + sub * token_stride, token_stride, c, group,
                                 head_dim, m + h, l + h, acc_h, first ? kn : 0, first ? vn : 0, next_count, softcap);
                }
                continue;
            }
#endif
            block_no512(qs_h, kb, vb, token_stride, count, group, head_dim, m + h, l + h, acc_h, kn, vn,
                           next_count, softcap);
        }
    }
}

/* One work item (as pagedserve_decode_part), normalized and written to the same heads of out_row (first > 0:
 * a sliding window). The fused decode step (decode_step.c) calls it for its own items. */
void pagedserve_decode_item(const float* q_row, const void* k_cache, const void* v_cache, float* out_row,
                            const int32_t* table, int32_t first, int32_t len, int kh0, int kh1, int32_t n_heads,
                            int32_t n_kv_heads, int32_t head_dim, int32_t block_size, float scale, float softcap,
                            const float* sinks, int kv_bf16) {
    float acc[MAX_STATE];
    float m[MAX_STATE / 16], l[MAX_STATE / 16]; /* per query head; head_dim >= 16 */
    pagedserve_decode_part(q_row, k_cache, v_cache, table, first, len, kh0, kh1, n_heads, n_kv_heads, head_dim,
                           block_size, scale, softcap, kv_bf16, acc, m, l);
    const int item_heads = (kh1 - kh0) * (n_heads / n_kv_heads);
    const int64_t head0 = (int64_t)kh0 * (n_heads / n_kv_heads);
    float* op = out_row + head0 * head_dim;
    for (int h = 0; h < item_heads; h++) {
        if (sinks) l[h] += expf(sinks[head0 + h] - m[h]); /* a sink's share of the softmax, no value */
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) op[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

/* Keys [from, to) of KV head kh, through the block table, for `heads` query rows laid out one after another in
 * qs / acc (each head_dim long) with their running max m and sum l: every key and value read once for all of
 * them. */
static void attend_range(float* qs, float* acc, float* m, float* l, int heads, const void* k_cache,
                         const void* v_cache, const int32_t* table, int from, int to, int kh, int head_dim,
                         int block_size, int64_t token_stride, int64_t block_stride, float softcap, int kv_bf16) {
    for (int start = from - from % block_size; start < to; start += block_size) {
        const int64_t block = table[start / block_size];
        const int skip = start < from ? from - start : 0;
        const int count = (to - start < block_size ? to - start : block_size) - skip;
        const int rest = to - start - block_size; /* keys after this block */
        const int next_count = rest < block_size ? (rest > 0 ? rest : 0) : block_size;
        const int64_t next = rest > 0 ? (int64_t)table[start / block_size + 1] * block_stride : 0;
        const int64_t at = block * block_stride + skip * token_stride + (int64_t)kh * head_dim;
        if (kv_bf16) {
            float kw[LANES * MAX_HEAD_DIM], vw[LANES * MAX_HEAD_DIM];
            for (int sub = 0; sub < count; sub += LANES) {
                const int c = count - sub < LANES ? count - sub : LANES;
                for (int t = 0; t < c; t++) {
                    kv_widen(k_cache, at + (sub + t) * token_stride, 1, kw + t * head_dim, head_dim);
                    kv_widen(v_cache, at + (sub + t) * token_stride, 1, vw + t * head_dim, head_dim);
                }
#if defined(__AVX512F__)
                if (head_dim % LANES == 0) {
                    block_avx512(qs, kw, vw, head_dim, c, heads, head_dim, m, l, acc, 0, 0, 0, softcap);
                    continue;
                }
#endif
                block_no512(qs, kw, vw, head_dim, c, heads, head_dim, m, l, acc, 0, 0, 0, softcap);
            }
            continue;
        }
        const float* kb = (const float*)k_cache + at;
        const float* vb = (const float*)v_cache + at;
        const float* kn = rest > 0 ? (const float*)k_cache + next + (int64_t)kh * head_dim : 0;
        const float* vn = rest > 0 ? (const float*)v_cache + next + (int64_t)kh * head_dim : 0;
#if defined(__AVX512F__)
        if (head_dim % LANES == 0) {
            for (int sub = 0; sub < count; sub += LANES) {
                const int c = count - sub < LANES ? count - sub : LANES;
                const int first = sub == 0;
                block_avx512(qs, kb + sub * token_stride, vb + sub * token_stride, token_stride, c, heads, head_dim,
                             m, l, acc, first ? kn : 0, first ? vn : 0, next_count, softcap);
            }
            continue;
        }
#endif
        block_no512(qs, kb, vb, token_stride, count, heads, head_dim, m, l, acc, kn, vn, next_count, softcap);
    }
}

/* Rows of a run one pagedserve_decode_run call holds in its state at once (more are done in further passes
   over the keys). */
int pagedserve_decode_run_rows(int32_t n_heads, int32_t n_kv_heads) {
    const int group = n_heads / n_kv_heads;
    return group <= MAX_GROUP ? MAX_GROUP / group : 1;
}

/* A run of n query rows of one sequence, its consecutive tokens (a drafting sequence's in a decode step): row
 * i (at q + i * q_row_stride, all query heads) attends to keys [0, len0 + i), KV head kh's group of heads,
 * written to out + i * out_row_stride. The keys all rows see are read once for the run, in chunks of rows
 * whose heads fill a GQA group's state; each of the last keys then serves the rows after it. No window. */
void pagedserve_decode_run(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                           float* out, int64_t out_row_stride, int32_t n, const int32_t* table, int32_t len0,
                           int32_t kh, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                           float scale, float softcap, int32_t kv_bf16) {
    const int group = n_heads / n_kv_heads;
    const int per = pagedserve_decode_run_rows(n_heads, n_kv_heads); /* rows whose heads one call holds */
    const int64_t token_stride = (int64_t)n_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    float qs[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    for (int r0 = 0; r0 < n; r0 += per) {
        const int rows = n - r0 < per ? n - r0 : per;
        const int len = len0 + r0; /* keys every row of the chunk sees */
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < group; g++) {
                const int h = r * group + g;
                const float* src = q + (int64_t)(r0 + r) * q_row_stride + ((int64_t)kh * group + g) * head_dim;
                m[h] = -INFINITY;
                l[h] = 0.0f;
                for (int d = 0; d < head_dim; d++) {
                    qs[h * head_dim + d] = src[d] * scale;
                    acc[h * head_dim + d] = 0.0f;
                }
            }
        attend_range(qs, acc, m, l, rows * group, k_cache, v_cache, table, 0, len, kh, head_dim, block_size,
                     token_stride, block_stride, softcap, kv_bf16);
        for (int t = 0; t + 1 < rows; t++) { /* key len + t: the rows after row t of the chunk see it */
            const int h = (t + 1) * group;
            attend_range(qs + h * head_dim, acc + h * head_dim, m + h, l + h, (rows - 1 - t) * group, k_cache,
                         v_cache, table, len + t, len + t + 1, kh, head_dim, block_size, token_stride,
                         block_stride, softcap, kv_bf16);
        }
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < group; g++) {
                const int h = r * group + g;
                const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
                float* dst = out + (int64_t)(r0 + r) * out_row_stride + ((int64_t)kh * group + g) * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) dst[d] = acc[h * head_dim + d] * inv;
            }
    }
}

/* Key ranges each of n decoding sequences' attention is cut into (shortest: the fewest keys among them). With
 * few sequences for the threads (one stream), a KV head an item read each head's rows across every block, 2 KB
 * apart at 1B's shape, at a third of a plain read; cut into block-aligned ranges of at least two blocks, each an
 * item with every KV head, a thread reads whole blocks, and the ranges' states are merged after
 * (pagedserve_decode_merge). 1: each sequence whole. */
int pagedserve_decode_splits(int32_t n, int32_t shortest, int32_t block_size) {
    const int threads = omp_get_max_threads();
    if (n >= 4 * threads || threads < 2) return 1;
    int splits = (4 * threads + n - 1) / n;
    const int most = shortest / block_size / 2;
    if (splits > most) splits = most;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    return splits < 2 ? 1 : splits;
}

/* Keys [*from, *to) of range j of `splits` over a sequence's keys [first, len), cut at block boundaries (empty
 * where a window leaves a range no block). */
void pagedserve_decode_range(int32_t first, int32_t len, int32_t block_size, int32_t splits, int32_t j,
                             int32_t* from, int32_t* to) {
    const int32_t b0 = first / block_size, blocks = (len + block_size - 1) / block_size - b0;
    const int32_t s0 = (b0 + (int32_t)((int64_t)blocks * j / splits)) * block_size;
    const int32_t s1 = (b0 + (int32_t)((int64_t)blocks * (j + 1) / splits)) * block_size;
    *from = s0 > first ? s0 : first;
    *to = s1 < len ? s1 : len;
    if (*to <= *from) *from = *to = s0; /* empty, at a block's start: no block is visited */
}

/* One query head's states over `splits` key ranges (range j's accumulator at acc + j * stride, its max and sum
 * at m[j * mstride], l[j * mstride]) as one softmax, written to out (head_dim values); sink: the head's sink
 * logit or NULL. */
void pagedserve_decode_merge(const float* acc, const float* m, const float* l, int splits, int64_t stride,
                             int64_t mstride, int head_dim, const float* sink, float* out) {
    float top = sink ? *sink : -INFINITY;
    for (int j = 0; j < splits; j++) top = m[j * mstride] > top ? m[j * mstride] : top;
    float sum = sink ? expf(*sink - top) : 0.0f, w[MAX_SPLITS];
    for (int j = 0; j < splits; j++) {
        w[j] = m[j * mstride] == -INFINITY ? 0.0f : expf(m[j * mstride] - top); /* an empty range weighs 0 */
        sum += l[j * mstride] * w[j];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int d = 0; d < head_dim; d++) {
        float o = 0.0f;
        for (int j = 0; j < splits; j++) o += w[j] * acc[j * stride + d];
        out[d] = o * inv;
    }
}

/* KV heads per work item: as many as an item's state holds (all of them for most models). */
int pagedserve_decode_heads_per_item(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim) {
    int heads_per_item = MAX_STATE / ((n_heads / n_kv_heads) * head_dim);
    return heads_per_item > n_kv_heads ? n_kv_heads : heads_per_item;
}

void pagedserve_paged_decode(
    const float* q,              /* [num_tokens, n_heads, head_dim] */
    const void* k_cache,         /* [num_blocks, block_size, n_kv_heads, head_dim], fp32 or bf16 (kv_bf16) */
    const void* v_cache,
    float* out,                  /* [num_tokens, n_heads, head_dim]; only the rows named are written */
    const int64_t* rows,         /* [n]: the query token of each decoding sequence */
    const int32_t* block_tables, /* [n, table_stride]: the table of each decoding sequence */
    int64_t table_stride,
    const int32_t* seq_lens,     /* [n]: keys of each sequence, this step's token included */
    int32_t n, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size, float scale,
    int32_t window,              /* > 0: each token sees only its last `window` keys (itself included) */
    float softcap,               /* > 0: each scaled score s is softcap * tanh(s / softcap) (Gemma 2) */
    const float* sinks,          /* [n_heads] or NULL: one more logit per head in each softmax (gpt-oss) */
    int32_t kv_bf16)             /* the pool holds bf16 */
{
    /* A work item is a sequence and as many of its KV heads as the item's state holds (all of them for most
     * models): it walks the sequence's blocks once, reading each block's rows of those heads in one pass.
     * With few sequences for the threads (one stream), each sequence's keys cut into ranges
     * (pagedserve_decode_splits), or, where they are too short to cut, a KV head an item. */
    const int few = n < 4 * omp_get_max_threads();
    int32_t shortest = n ? seq_lens[0] : 0;
    for (int i = 1; i < n; i++) shortest = seq_lens[i] < shortest ? seq_lens[i] : shortest;
    int splits = pagedserve_decode_splits(n, shortest, block_size);
    const int64_t row_state = (int64_t)splits * n_heads * (head_dim + 2); /* a sequence's ranges' states */
    float* state = splits > 1 ? malloc(sizeof(float) * (size_t)(n * row_state)) : 0;
    if (state == 0) splits = 1; /* no memory for the states: each sequence whole */
    const int heads_per_item = few && splits == 1 ? 1 : pagedserve_decode_heads_per_item(n_heads, n_kv_heads, head_dim);
    const int chunks = (n_kv_heads + heads_per_item - 1) / heads_per_item;
    const int group = n_heads / n_kv_heads;

#pragma omp parallel
    {
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < splits; j++) {
                for (int chunk = 0; chunk < chunks; chunk++) {
                    const int kh0 = chunk * heads_per_item;
                    const int kh1 = kh0 + heads_per_item < n_kv_heads ? kh0 + heads_per_item : n_kv_heads;
                    const int64_t row = rows[i] * n_heads * head_dim;
                    const int32_t first = window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
                    const int32_t* table = block_tables + (int64_t)i * table_stride;
                    if (splits == 1) {
                        pagedserve_decode_item(q + row, k_cache, v_cache, out + row, table, first, seq_lens[i], kh0,
                                               kh1, n_heads, n_kv_heads, head_dim, block_size, scale, softcap, sinks,
                                               kv_bf16);
                        continue;
                    }
                    int32_t from, to;
                    pagedserve_decode_range(first, seq_lens[i], block_size, splits, j, &from, &to);
                    float* st = state + i * row_state + (int64_t)j * n_heads * head_dim;
                    float* ml = state + i * row_state + (int64_t)splits * n_heads * head_dim + (int64_t)j * n_heads;
                    const int64_t h0 = (int64_t)kh0 * group;
                    pagedserve_decode_part(q + row, k_cache, v_cache, table, from, to, kh0, kh1, n_heads, n_kv_heads,
                                           head_dim, block_size, scale, softcap, kv_bf16, st + h0 * head_dim, ml + h0,
                                           ml + (int64_t)splits * n_heads + h0);
                }
            }
        }
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < (int64_t)n * n_heads; it++) {
                const int64_t i = it / n_heads, h = it % n_heads;
                const float* st = state + i * row_state;
                const float* ml = st + (int64_t)splits * n_heads * head_dim;
                pagedserve_decode_merge(st + h * head_dim, ml + h, ml + (int64_t)splits * n_heads + h, splits,
                                        (int64_t)n_heads * head_dim, n_heads, head_dim, sinks ? sinks + h : 0,
                                        out + (rows[i] * n_heads + h) * head_dim);
            }
        }
    }
    free(state);
}
