/* Q4_0 / Q4_1 weights repacked at load for decode: 16 output rows interleaved, activations as 16-bit integers.

   A decode step's matmuls read every weight once. On GGUF's own layout each 32-value block of a row is
   dequantized into floats before its multiply-adds (quant_blocks.h), ~6 cycles a block: on a 2-core VM
   that kept the layers at ~11 GB/s where the memory gives ~20. Here 16 rows are interleaved so each 32-bit
   lane of a vector belongs to one output row, and the multiply-adds are integer dot products (AVX-512 VNNI
   `vpdpbusd`: 64 of them an instruction) of the 4-bit weights with the activations rounded to 16-bit
   integers: one scale per 32 activations, amax / 32767 — 2^-16 of the block's largest value, where
   llama.cpp's 8-bit activations (amax / 127) cost a 135M model 1.3% perplexity. A 16-bit activation
   q = 256 hi + lo is two byte dot products (lo unsigned against the weights as signed, the weights as
   unsigned against hi signed). Each block's scale and offset then apply to 16 rows at once.

   Layout: for each group of 16 rows, for each 32-value block, 320 bytes (the 16 rows' 20 bytes, rearranged):
     4 x 64 bytes of nibbles: in part k, byte 4 r + t holds row r's value 4k + t (low half) and 16 + 4k + t
                             (high half), r = 0..15, t = 0..3
     16 x fp16 d, then 16 x fp16 m             w = d q + m  (Q4_0 packs as m = -8 d, exact in fp16)
   A block's contribution to row r is  d_r dx (sum_j q_rj qx_j) + m_r (sum_j x_j): the integer sum is exact,
   the offset term uses the activations' fp32 sum. */
#ifndef PAGEDSERVE_PACKED_Q4_H
#define PAGEDSERVE_PACKED_Q4_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#define PACKED_Q4 100 /* the type id the kernels know the packed layout by (not a ggml type) */
#define PACK_ROWS 16
#define PACK_BLOCK_BYTES 320 /* a group's 32-value block: 256 bytes of nibbles, 16 d, 16 m */
#define PACK_XROWS 4         /* activation rows per pass over a group's weights (accumulators in registers) */

/* Activations of a matmul as the packed kernel reads them: per row and 32-value block, the 16-bit integers
   split into their low (unsigned) and high (signed) bytes, the scale, and the block's fp32 sum. */
typedef struct {
    uint8_t *lo; /* [rows][in_dim] */
    int8_t *hi;  /* [rows][in_dim] */
    float *d;    /* [rows][in_dim / 32] */
    float *sum;  /* [rows][in_dim / 32] */
} PackedX;

/* Bytes of PackedX storage for rows x in_dim (lo, hi, then the floats, 64-byte aligned parts). */
static inline int64_t packed_x_bytes(int64_t rows, int64_t in_dim) {
    const int64_t b = (rows * in_dim + 63) / 64 * 64;
    return 2 * b + 2 * (int64_t)sizeof(float) * ((rows * (in_dim / QK) + 15) / 16 * 16);
}

static inline PackedX packed_x_at(void *mem, int64_t rows, int64_t in_dim) {
    const int64_t b = (rows * in_dim + 63) / 64 * 64, f = (rows * (in_dim / QK) + 15) / 16 * 16;
    PackedX p;
    p.lo = (uint8_t *)mem;
    p.hi = (int8_t *)((uint8_t *)mem + b);
    p.d = (float *)((uint8_t *)mem + 2 * b);
    p.sum = p.d + f;
    return p;
}

/* Block i of the whole activation matrix (rows are contiguous, in_dim a multiple of 32). A NaN or an
   infinity rounds to 0 (an infinite amax gives scale infinity and integers 0), and the block's sum carries it
   into every output through the offset term, NaN where the fp32 product would be NaN or infinite. */
static inline void packed_x_block(const float *x, PackedX p, int64_t i) {
    const float *xb = x + i * QK;
    float amax = 0.0f, s = 0.0f;
    for (int j = 0; j < QK; j++) {
        amax = fmaxf(amax, fabsf(xb[j]));
        s += xb[j];
    }
    const float d = amax / 32767.0f, inv = 32767.0f / amax;
    const float id = d > 0.0f && isfinite(d) && isfinite(inv) ? inv : 0.0f; /* 0: a block of zeros (or ~1e-38) */
    for (int j = 0; j < QK; j++) {
        float v = nearbyintf(xb[j] * id);
        v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
        const int q = v == v ? (int)v : 0;
        p.lo[i * QK + j] = (uint8_t)(q & 255);
        p.hi[i * QK + j] = (int8_t)((q - (q & 255)) / 256);
    }
    p.d[i] = d;
    p.sum[i] = s;
}

/* fp32 -> fp16 bits, rounded to nearest even (only exact values reach it here: -8 d of a Q4_0 block). */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0); /* inf, NaN */
    if (ax >= 0x477ff000) return sign | 0x7c00;                                  /* rounds past 65504 */
    if (ax < 0x38800000) {                                                        /* fp16 subnormal or 0 */
        if (ax < 0x33000000) return sign;
        const uint32_t mant = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
        uint32_t h = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((ax >> 13) - (112u << 10));
    const uint32_t rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
#endif
}

/* Rows [o0, o0 + 16 n) of a Q4_0 / Q4_1 matrix -> n packed groups (out: n * nblocks * 320 bytes). */
static inline void pack_q4_groups(const uint8_t *w, int type, int64_t nblocks, int64_t g0, int64_t n, uint8_t *out) {
    const int bb = block_bytes(type), off = type == Q4_1 ? 4 : 2;
    for (int64_t g = g0; g < g0 + n; g++)
        for (int64_t b = 0; b < nblocks; b++) {
            uint8_t *dst = out + (g * nblocks + b) * PACK_BLOCK_BYTES;
            uint16_t *dm = (uint16_t *)(dst + 256);
            for (int r = 0; r < PACK_ROWS; r++) {
                const uint8_t *src = w + ((g * PACK_ROWS + r) * nblocks + b) * bb;
                const uint16_t d = read_u16(src);
                dm[r] = d;
                if (type == Q4_1) {
                    dm[16 + r] = read_u16(src + 2);
                } else { /* w = d (q - 8) = d q + m with m = -8 d, exact in fp16 below its overflow */
                    dm[16 + r] = float_to_half(-8.0f * half_to_float(d));
                }
                for (int k = 0; k < 4; k++)
                    for (int t = 0; t < 4; t++) dst[64 * k + 4 * r + t] = src[off + 4 * k + t];
            }
        }
}

/* One packed value: row r's value j of a group-block, as a float (d q + m). */
static inline float packed_value(const uint8_t *blk, int r, int j) {
    const int lo = j < 16, jj = lo ? j : j - 16;
    const uint8_t byte = blk[64 * (jj / 4) + 4 * r + jj % 4];
    const int q = lo ? byte & 15 : byte >> 4;
    const uint16_t *dm = (const uint16_t *)(blk + 256);
    return half_to_float(dm[r]) * (float)q + half_to_float(dm[16 + r]);
}

/* out[r * 16 + i] = row i of the group . activation row r, for nr <= PACK_XROWS rows of x. */
static inline __attribute__((always_inline)) void packed_group_dot_n(const uint8_t *grp, int64_t nblocks, PackedX x,
                                                                      int64_t in_dim, const int nr, float *out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[PACK_XROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *p = grp + b * PACK_BLOCK_BYTES;
        __builtin_prefetch(p + 4096, 0, 3);
        __builtin_prefetch(p + 4096 + 64, 0, 3);
        __builtin_prefetch(p + 4096 + 128, 0, 3);
        __builtin_prefetch(p + 4096 + 192, 0, 3);
        __builtin_prefetch(p + 4096 + 256, 0, 3);
        __m512i ilo[PACK_XROWS], ihi[PACK_XROWS];
        for (int r = 0; r < nr; r++) ilo[r] = ihi[r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(p + 64 * k));
            const __m512i wl = _mm512_and_si512(raw, nib), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            for (int r = 0; r < nr; r++) {
                const int64_t at = r * in_dim + b * QK + 4 * k;
                int32_t l0, l1, h0, h1;
                memcpy(&l0, x.lo + at, 4);
                memcpy(&l1, x.lo + at + 16, 4);
                memcpy(&h0, x.hi + at, 4);
                memcpy(&h1, x.hi + at + 16, 4);
                ilo[r] = _mm512_dpbusd_epi32(ilo[r], _mm512_set1_epi32(l0), wl);
                ilo[r] = _mm512_dpbusd_epi32(ilo[r], _mm512_set1_epi32(l1), wh);
                ihi[r] = _mm512_dpbusd_epi32(ihi[r], wl, _mm512_set1_epi32(h0));
                ihi[r] = _mm512_dpbusd_epi32(ihi[r], wh, _mm512_set1_epi32(h1));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        for (int r = 0; r < nr; r++) {
            const int64_t xb = r * (in_dim / QK) + b;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ihi[r], 8), ilo[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.d[xb])), d, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[xb]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
#else
    /* the same integer sums and the same scaling, in plain loops the compiler vectorizes */
    float acc[PACK_XROWS][PACK_ROWS];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) acc[r][i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *p = grp + b * PACK_BLOCK_BYTES;
        const uint16_t *dm = (const uint16_t *)(p + 256);
        for (int r = 0; r < nr; r++) {
            const int64_t at = r * in_dim + b * QK, xb = r * (in_dim / QK) + b;
            int32_t ilo[PACK_ROWS] = {0}, ihi[PACK_ROWS] = {0};
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < PACK_ROWS; i++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t byte = p[64 * k + 4 * i + t];
                        const int j = 4 * k + t;
                        ilo[i] += (byte & 15) * x.lo[at + j] + (byte >> 4) * x.lo[at + j + 16];
                        ihi[i] += (byte & 15) * x.hi[at + j] + (byte >> 4) * x.hi[at + j + 16];
                    }
            for (int i = 0; i < PACK_ROWS; i++) {
                const float dot = (float)(ihi[i] * 256 + ilo[i]);
                acc[r][i] = fmaf(dot * x.d[xb], half_to_float(dm[i]), acc[r][i]);
                acc[r][i] = fmaf(half_to_float(dm[16 + i]), x.sum[xb], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) out[r * 16 + i] = acc[r][i];
#endif
}

/* out[r * 16 + i] for any number of activation rows, PACK_XROWS at a time (the group's weights stay in L1
   between passes). */
static inline void packed_group_dot(const uint8_t *grp, int64_t nblocks, PackedX x, int64_t in_dim, int64_t rows,
                                    float *out) {
    for (int64_t r0 = 0; r0 < rows; r0 += PACK_XROWS) {
        PackedX xr = x;
        xr.lo += r0 * in_dim;
        xr.hi += r0 * in_dim;
        xr.d += r0 * (in_dim / QK);
        xr.sum += r0 * (in_dim / QK);
        float *o = out + r0 * PACK_ROWS;
        switch (rows - r0 < PACK_XROWS ? rows - r0 : PACK_XROWS) {
            case 1: packed_group_dot_n(grp, nblocks, xr, in_dim, 1, o); break;
            case 2: packed_group_dot_n(grp, nblocks, xr, in_dim, 2, o); break;
            case 3: packed_group_dot_n(grp, nblocks, xr, in_dim, 3, o); break;
            default: packed_group_dot_n(grp, nblocks, xr, in_dim, PACK_XROWS, o); break;
        }
    }
}

#endif
