/* Weight-only quantized matmuls on GGUF blocks, as the file ships them: y[r, o] = sum_k x[r, k] * W[o, k].

   W is out_dim rows of in_dim / 32 blocks each, in ggml's layouts (type ids as ggml numbers them):
     Q4_0 (2):  fp16 d, 16 bytes of nibbles          w = d * (q - 8)
     Q4_1 (3):  fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
     Q8_0 (8):  fp16 d, 32 int8                      w = d * q
   nibble j of a block is byte j's low half for j < 16 and byte (j - 16)'s high half after.

   x and y are fp32. Each thread takes whole output rows and dequantizes each block once, into registers,
   for up to ROWS rows of x at a time: at decode (a few rows) the weights are read once, as 4.5-8.5 bits
   each instead of fp32's 32. The library is built with -march=native on the machine that runs it
   (kernels/cpu_native.py), so the AVX-512 path is taken where the CPU has it and the portable loop,
   which the compiler vectorizes for AVX2 or whatever the machine has, elsewhere.
   pagedserve_quant_dequant writes the fp32 matrix (prefill hands it to oneDNN / BLAS). */
#include <math.h>
#include <stdlib.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_bf16.h"
#include "bf16_dots.h"
#include "pagedserve.h"
#include "packed_blocks.h"
#include "quant_blocks.h"
#include "rows.h"

/* The vector width the library was built for: 512 (AVX-512 intrinsics), 256 (AVX2: the portable loops,
   vectorized by the compiler) or 0. */
int pagedserve_native_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

/* 1 where the packed kernel has its integer dot products (AVX-512 VNNI, or AVX2's maddubs for the 4-6 bit
   layouts); 0: its portable loop, slower than the fp32-activation kernel on GGUF's own layout, so the worker
   packs nothing there. */
int pagedserve_packed_fast(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(PACKED_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* 1 where PACKED_Q8 has its integer dot products too: AVX-512 VNNI; AVX2 against 8-bit activations only
   (bits8; see avx2_dot). */
int pagedserve_packed_q8_fast(int bits8) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#elif defined(PACKED_AVX2)
    return bits8 != 0;
#else
    (void)bits8;
    return 0;
#endif
}



/* Whether every Q5_0 block's -16 d (PACKED_Q5's offset) is finite in fp16. */
static int q5_0_packable(const uint8_t *w, int64_t nblocks_total) {
    for (int64_t i = 0; i < nblocks_total; i++)
        if (fabsf(half_at(((const BlockQ5_0 *)(w + i * sizeof(BlockQ5_0)))->d)) * 16.0f > 65504.0f) return 0;
    return 1;
}

/* A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / MXFP4 / K-quant matrix [out_dim, in_dim] -> its packed layout
   (packed_blocks.h: PACKED_Q4 for the Q4 types, PACKED_Q5 for the Q5 ones, PACKED_Q8, PACKED_MX4, PACKED_Q4K
   ...), out_dim / 16 groups of its blocks. Returns 0, or -1 (another type, out_dim not a multiple of 16,
   in_dim not of the block, a scale or offset that fp16 cannot hold). */
int pagedserve_pack(const uint8_t *w, int64_t out_dim, int64_t in_dim, int32_t type, uint8_t *out) {
    const int k = is_k_quant(type);
    const int q32 = type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == MXFP4;
    if ((!q32 && !k) || out_dim % PACK_ROWS || out_dim <= 0 || in_dim % block_values(type) || in_dim <= 0)
        return -1;
    if (type == MXFP4 && !mx4_packable(w, out_dim * (in_dim / QK))) return -1;
    if (type == Q5_0 && !q5_0_packable(w, out_dim * (in_dim / QK))) return -1;
    const int64_t groups = out_dim / PACK_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (k)
            pack_k_groups(w, type, in_dim / QK_K, g, 1, out);
        else
            pack_groups(w, type, in_dim / QK, g, 1, out);
    }
    return 0;
}

/* y[r, o] = x[r] . row o of w, rows [o0, o1) (whole groups of 16 where packed) for n rows; x as px where
   packed. Called by every thread inside an `omp for` over output chunks (packed_matmul's, the experts'). */
void block_rows(int32_t type, const uint8_t *w, const float *x, PackedX px, int64_t n, int64_t in_dim,
                        int64_t out_dim, int64_t o0, int64_t o1, float *y) {
    const int64_t nb = in_dim / QK;
    if (packed_type(type)) {
        const int64_t gb = nb * pack_block_bytes(type), pitch = packed_x_pitch(in_dim);
        for (int64_t g = o0 / PACK_ROWS; g < o1 / PACK_ROWS; g++)
            for (int64_t r0 = 0; r0 < n; r0 += PACK_TILE) {
                const int64_t nr = n - r0 < PACK_TILE ? n - r0 : PACK_TILE;
                float part[PACK_TILE * PACK_ROWS];
                packed_group_dot(type, w + g * gb, nb, packed_x_rows(px, r0, pitch), pitch, nr, part);
                for (int64_t r = 0; r < nr; r++)
                    memcpy(y + (r0 + r) * out_dim + g * PACK_ROWS, part + r * PACK_ROWS, sizeof(float) * PACK_ROWS);
            }
        return;
    }
    const int64_t rb = row_bytes(type, in_dim);
    for (int64_t o = o0; o < o1; o++) {
        float acc[ROWS];
        for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
            const int nr = (int)(n - r0 < ROWS ? n - r0 : ROWS);
            rows_dot(type, w + o * rb, nb, x + r0 * in_dim, in_dim, nr, acc);
            for (int r = 0; r < nr; r++) y[(r0 + r) * out_dim + o] = acc[r];
        }
    }
}

/* y = x @ W^T on packed weights: the activations rounded to 16-bit integers per 32-value block (8-bit with
   bits8), then each thread takes whole groups of 16 output rows. -2: no memory for the rounded activations. */
static int packed_matmul(const float *x, int64_t rows, int64_t in_dim, const uint8_t *w, int64_t out_dim,
                         int32_t ptype, float *y, int bits8) {
    if (out_dim % PACK_ROWS || in_dim % QK || (packed_is_k(ptype) && in_dim % QK_K)) return -1;
    const int64_t nb = in_dim / QK, groups = out_dim / PACK_ROWS;
    void *mem = aligned_alloc(64, (size_t)((packed_x_bytes(rows, packed_x_pitch(in_dim)) + 63) / 64 * 64));
    if (!mem) return -2;
    PackedX px = packed_x_at(mem, rows, packed_x_pitch(in_dim));
    px.bits8 = bits8;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * nb; i++) packed_x_block(x, px, i, nb);
        /* runs of groups, guided: each thread starts on a contiguous share (the weights stream as with a static
           split), and the rest goes out in shrinking runs, so a vCPU the host takes away for a while (these VMs'
           noise) does not hold the other at the end; a Q4_K matmul with one core shared: x1.20 */
        const int64_t per = groups >= 64 ? groups / 64 : 1, runs = (groups + per - 1) / per;
#pragma omp for schedule(guided)
        for (int64_t c = 0; c < runs; c++) {
            const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
            block_rows(ptype, w, x, px, rows, in_dim, out_dim, c * per * PACK_ROWS, g1 * PACK_ROWS, y);
        }
    }
    free(mem);
    return 0;
}

/* Linux hands a process the AMX tile state only once asked (ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once, the
   answer kept. pagedserve_bf16_rounded(0) turns the BF16 rows' tiles and dot products off (the row kernel's fp32
   activations). */
static int amx_state = -1, rounded_allowed = 1;

int amx_permitted(void) {
#if defined(__AMX_TILE__) && defined(__linux__)
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
#else
    return 0;
#endif
}

int amx_bf16_ready(void) {
#ifdef AMX_BF16
    return rounded_allowed && amx_permitted();
#else
    return 0;
#endif
}

int bf16_dots_ready(void) { return BF16_DOTS && rounded_allowed; }

/* 1: BF16 rows at bf16-rounded activations where the CPU multiplies them (the default); 0: the row kernel's fp32
   activations; -1 asks. Returns 2 (AMX tiles), 1 (AVX512_BF16 dot products) or 0 (the row kernel). */
int pagedserve_bf16_rounded(int32_t on) {
    if (on >= 0) rounded_allowed = on != 0;
    return amx_bf16_ready() ? 2 : bf16_dots_ready();
}

/* y = x @ W^T for BF16 rows on AVX512_BF16 dot products (bf16_dots.h): the activations rounded once, then runs of
   32 output rows over the threads (guided). -2: no memory for the rounded rows. */
static int dots_matmul(const float *x, int64_t rows, int64_t in_dim, const uint8_t *w, int64_t out_dim, float *y) {
#if BF16_DOTS
    uint16_t *xb = aligned_alloc(64, (size_t)(rows * in_dim * 2));
    if (!xb) return -2;
    const int64_t runs = (out_dim + 31) / 32;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) dots_x_row(x, rows, in_dim, xb, r);
#pragma omp for schedule(guided)
        for (int64_t c = 0; c < runs; c++)
            dots_span((const uint16_t *)w + c * 32 * in_dim, in_dim, xb, rows, c * 32,
                      c * 32 + 32 < out_dim ? c * 32 + 32 : out_dim, y, out_dim, out_dim);
    }
    free(xb);
    return 0;
#else
    (void)x, (void)rows, (void)in_dim, (void)w, (void)out_dim, (void)y;
    return -1;
#endif
}

/* y = x @ W^T for BF16 rows on AMX tiles: the activations as tiles (amx_x_tile), then whole groups of 16 output
   rows split over the threads as runs (guided, as packed_matmul's); the rows past the last 16 on the row
   kernel. -2: no memory for the tiles. */
static int amx_matmul(const float *x, int64_t rows, int64_t in_dim, const uint8_t *w, int64_t out_dim, float *y) {
#ifdef AMX_BF16
    const int64_t tiles = (rows + AMX_ROWS - 1) / AMX_ROWS * (in_dim / AMX_K), groups = out_dim / AMX_ROWS;
    uint16_t *xp = aligned_alloc(64, (size_t)amx_x_bytes(rows, in_dim));
    if (!xp) return -2;
    const int64_t per = groups >= 64 ? groups / 64 : 1, runs = (groups + per - 1) / per;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) amx_x_tile(x, rows, in_dim, xp, t);
        amx_begin();
#pragma omp for schedule(guided) nowait
        for (int64_t c = 0; c < runs; c++) {
            const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
            for (int64_t g = c * per; g < g1; g++)
                amx_group((const uint16_t *)w + g * AMX_ROWS * in_dim, in_dim, xp, rows, y, out_dim, g * AMX_ROWS);
        }
        amx_end();
#pragma omp for schedule(static)
        for (int64_t o = groups * AMX_ROWS; o < out_dim; o++) {
            float acc[ROWS];
            for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                const int nr = (int)(rows - r0 < ROWS ? rows - r0 : ROWS);
                rows_dot(BF16, w + o * in_dim * 2, in_dim / QK, x + r0 * in_dim, in_dim, nr, acc);
                for (int r = 0; r < nr; r++) y[(r0 + r) * out_dim + o] = acc[r];
            }
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)rows, (void)in_dim, (void)w, (void)out_dim, (void)y;
    return -1;
#endif
}

/* Returns 0, or -1 when the type or shape is not served (in_dim must be a multiple of 32). */
int pagedserve_quant_matmul(const float *x, int64_t rows, int64_t in_dim, const uint8_t *w, int64_t out_dim,
                            int32_t type, float *y) {
    if (rows <= 0 || out_dim <= 0) return 0; /* nothing to multiply (a step without logits rows) */
    if (packed_type(type)) return packed_matmul(x, rows, in_dim, w, out_dim, type, y, 0);
    if (!block_bytes(type) || in_dim % block_values(type)) return -1;
    if (type == BF16 && amx_shape(in_dim) && amx_bf16_ready()) return amx_matmul(x, rows, in_dim, w, out_dim, y);
    if (type == BF16 && bf16_dots_ready()) return dots_matmul(x, rows, in_dim, w, out_dim, y);
#if WIDE_ROWS
    if (widened_type(type) && rows >= WIDE_GEMM_ROWS) /* a prompt's rows: widened panels (widened_gemm.c) */
        return pagedserve_widened_gemm(x, rows, in_dim, w, out_dim, type, y);
    if (widened_type(type)) { /* whole passes of several weight rows (widened_rows.h) */
        const int64_t step = widened_cols(rows, out_dim), groups = (out_dim + step - 1) / step;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t o0 = g * step, o1 = o0 + step < out_dim ? o0 + step : out_dim;
            widened_span(type, w + o0 * row_bytes(type, in_dim), in_dim, x, rows, o0, o1, y, out_dim);
        }
        return 0;
    }
#endif
    const int64_t nblocks = in_dim / QK, rb = row_bytes(type, in_dim);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out_dim; o++) {
        const uint8_t *wrow = w + o * rb;
        float acc[ROWS];
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            const int nr = (int)(rows - r0 < ROWS ? rows - r0 : ROWS);
            rows_dot(type, wrow, nblocks, x + r0 * in_dim, in_dim, nr, acc);
            for (int r = 0; r < nr; r++) y[(r0 + r) * out_dim + o] = acc[r];
        }
    }
    return 0;
}

/* The fp32 matrix [out_dim, in_dim]. */
/* Below this many values (a decode step's embedding rows) one thread dequantizes: a region for a few
   microseconds of work waits on the whole team, and a teammate the host has preempted holds it for a
   time slice. */
#define DEQUANT_PARALLEL (1 << 16)
int pagedserve_quant_dequant(const uint8_t *w, int64_t out_dim, int64_t in_dim, int32_t type, float *out) {
    if (packed_type(type)) {
        if (out_dim % PACK_ROWS || in_dim % QK) return -1;
        if (packed_is_k(type) && in_dim % QK_K) return -1;
        const int64_t nb = in_dim / QK, pb = pack_block_bytes(type);
#pragma omp parallel for schedule(static) if (out_dim * in_dim >= DEQUANT_PARALLEL)
        for (int64_t g = 0; g < out_dim / PACK_ROWS; g++)
            for (int64_t b = 0; b < nb; b++)
                for (int r = 0; r < PACK_ROWS; r++)
                    for (int j = 0; j < QK; j++)
                        out[(g * PACK_ROWS + r) * in_dim + b * QK + j] =
                            packed_is_k(type) ? packed_k_value(type, w + g * nb * pb, b, r, j)
                                              : packed_value(type, w + (g * nb + b) * pb, r, j);
        return 0;
    }
    if (!block_bytes(type) || in_dim % block_values(type)) return -1;
    const int64_t nblocks = in_dim / QK, rb = row_bytes(type, in_dim);
#pragma omp parallel for schedule(static) if (out_dim * in_dim >= DEQUANT_PARALLEL)
    for (int64_t o = 0; o < out_dim; o++)
        for (int64_t blk = 0; blk < nblocks; blk++) dequant_sub(type, w + o * rb, blk, out + o * in_dim + blk * QK);
    return 0;
}

/* --- int8 activations (llama.cpp's scheme): x quantized per 32-value block to int8 with the block's scale
   amax / 127, then integer dot products against the weight blocks (AVX-512 VNNI: 64 multiply-adds per
   instruction), each block's sum scaled by both scales. Faster where the dequantize-and-FMA loop is the
   limit, at the cost of rounding the activations to 8 bits. */

typedef struct {
    int8_t *q;      /* [rows][in_dim] */
    float *d;       /* [rows][nblocks] the block's scale */
    int32_t *sum;   /* [rows][nblocks] the sum of the block's int8 values */
} QuantX;

static int quantize_x(const float *x, int64_t rows, int64_t in_dim, QuantX *out) {
    const int64_t nb = in_dim / QK;
    out->q = malloc((size_t)(rows * in_dim));
    out->d = malloc(sizeof(float) * (size_t)(rows * nb));
    out->sum = malloc(sizeof(int32_t) * (size_t)(rows * nb));
    if (!out->q || !out->d || !out->sum) return -1;
#pragma omp parallel for schedule(static) if (rows * nb > 64)
    for (int64_t i = 0; i < rows * nb; i++) {
        const float *xb = x + i * QK;  /* rows are contiguous, so block i of the whole matrix */
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)roundf(xb[j] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            out->q[i * QK + j] = (int8_t)v;
            s += v;
        }
        out->d[i] = d;
        out->sum[i] = s;
    }
    return 0;
}

/* sum_j w_j * x_j for one block in integers, w as stored (nibbles 0..15 for Q4_0/Q4_1, int8 for Q8_0). */
static inline int32_t block_idot(int type, const uint8_t *b, const int8_t *xq) {
    int32_t s = 0;
    if (type == Q8_0) {
        const int8_t *q = ((const BlockQ8_0 *)b)->qs;
        for (int j = 0; j < QK; j++) s += (int32_t)q[j] * xq[j];
    } else {
        const uint8_t *q = q4_nibbles(type, b);
        for (int j = 0; j < QK / 2; j++) s += (int32_t)(q[j] & 0x0f) * xq[j] + (int32_t)(q[j] >> 4) * xq[j + QK / 2];
    }
    return s;
}

/* The block's contribution given its integer dot: d_w * d_x * dot, with Q4_0's -8 and Q4_1's offset. */
static inline float block_value(int type, const uint8_t *b, int32_t dot, float dx, int32_t xsum) {
    const float dw = half_at(b);
    if (type == Q4_1) return dw * dx * (float)dot + half_at(((const BlockQ4_1 *)b)->m) * dx * (float)xsum;
    if (type == Q4_0) return dw * dx * (float)(dot - 8 * xsum);
    return dw * dx * (float)dot;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Two blocks' weights as 64 unsigned bytes lined up with their activations, and the sign fix for Q8_0. */
static inline __m512i pair_dot(int type, const uint8_t *b0, const uint8_t *b1, const int8_t *xq) {
    __m512i x = _mm512_loadu_si512((const void *)xq);
    if (type == Q8_0) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)((const BlockQ8_0 *)b0)->qs);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)((const BlockQ8_0 *)b1)->qs);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
        __mmask64 neg = _mm512_movepi8_mask(w);
        x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);  /* x * sign(w): |w| * that = w * x */
        return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), x);
    }
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i q0 = _mm_loadu_si128((const __m128i *)q4_nibbles(type, b0));
    __m128i q1 = _mm_loadu_si128((const __m128i *)q4_nibbles(type, b1));
    __m256i n0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q0, 4), mask), _mm_and_si128(q0, mask));
    __m256i n1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q1, 4), mask), _mm_and_si128(q1, mask));
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(n0), n1, 1);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
}
#endif

static float row_dot_q8(int type, const uint8_t *wrow, int64_t nb, const int8_t *xq, const float *xd,
                        const int32_t *xsum) {
    const int bb = block_bytes(type);
    float total = 0.0f;
    int64_t blk = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512 acc = _mm512_setzero_ps();
    for (; blk + 1 < nb; blk += 2) {
        const uint8_t *b0 = wrow + blk * bb, *b1 = b0 + bb;
        __m512 dots = _mm512_cvtepi32_ps(pair_dot(type, b0, b1, xq + blk * QK));
        const float s0 = half_at(b0) * xd[blk], s1 = half_at(b1) * xd[blk + 1];
        acc = _mm512_fmadd_ps(dots, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)), acc);
        if (type == Q4_1) {
            total += half_at(((const BlockQ4_1 *)b0)->m) * xd[blk] * (float)xsum[blk]
                   + half_at(((const BlockQ4_1 *)b1)->m) * xd[blk + 1] * (float)xsum[blk + 1];
        } else if (type == Q4_0) {
            total -= 8.0f * (s0 * (float)xsum[blk] + s1 * (float)xsum[blk + 1]);
        }
    }
    total += _mm512_reduce_add_ps(acc);
#endif
    for (; blk < nb; blk++) {
        const uint8_t *b = wrow + blk * bb;
        total += block_value(type, b, block_idot(type, b, xq + blk * QK), xd[blk], xsum[blk]);
    }
    return total;
}

int pagedserve_quant_matmul_q8act(const float *x, int64_t rows, int64_t in_dim, const uint8_t *w, int64_t out_dim,
                                  int32_t type, float *y) {
    if (packed_type(type)) return packed_matmul(x, rows, in_dim, w, out_dim, type, y, 1); /* 8-bit per block */
    const int bb = block_bytes(type);
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || in_dim % QK) return -1; /* the 32-value integer types */
    const int64_t nb = in_dim / QK, rb = nb * bb;
    QuantX xq;
    if (quantize_x(x, rows, in_dim, &xq)) {
        free(xq.q); free(xq.d); free(xq.sum);
        return -2;
    }
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out_dim; o++)
        for (int64_t r = 0; r < rows; r++)
            y[r * out_dim + o] = row_dot_q8(type, w + o * rb, nb, xq.q + r * in_dim, xq.d + r * nb,
                                            xq.sum + r * nb);
    free(xq.q); free(xq.d); free(xq.sum);
    return 0;
}
