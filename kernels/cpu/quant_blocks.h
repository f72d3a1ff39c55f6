/* GGUF weight blocks read by the CPU kernels (quant_matmul.c, decode_step.c): layouts, dequantization, and
   the dot products of up to ROWS activation rows with one weight row. Type 0 is a plain fp32 row (a
   "block" of 32 floats), so the fused decode step runs dense and quantized weights through one loop; F16 (1)
   and BF16 (30) rows are read the same way, 32 half-width values a block (a bf16 checkpoint's weights at
   half fp32's bytes, exact: bf16 -> fp32 is a 16-bit shift). */
#ifndef PAGEDSERVE_QUANT_BLOCKS_H
#define PAGEDSERVE_QUANT_BLOCKS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define ROWS 8

enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
    MXFP4 = 39
};

/* GGUF's blocks, laid out as ggml declares them. The fp16 scales are two bytes each, so every struct has
   alignment 1 and a block may start at any byte of a row; the static asserts pin each layout to the file's.
   The K-quants (Q4_K, Q5_K, Q6_K) pack 256 values a block with a scale per 32 (Q4_K and Q5_K, and a min) or
   per 16 (Q6_K); the loops below walk every type in 32-value sub-blocks. */
typedef struct { uint8_t d[2], qs[QK / 2]; } BlockQ4_0;                    /* w = d (q - 8) */
typedef struct { uint8_t d[2], m[2], qs[QK / 2]; } BlockQ4_1;              /* w = d q + m */
typedef struct { uint8_t d[2], qh[4], qs[QK / 2]; } BlockQ5_0;             /* w = d (u - 16), bit j of qh: u_j's fifth */
typedef struct { uint8_t d[2], m[2], qh[4], qs[QK / 2]; } BlockQ5_1;       /* w = d u + m */
typedef struct { uint8_t d[2]; int8_t qs[QK]; } BlockQ8_0;                 /* w = d q */
typedef struct { uint8_t d[2], dmin[2], scales[12], qs[128]; } BlockQ4_K;  /* 6-bit scales and mins, packed */
typedef struct { uint8_t d[2], dmin[2], scales[12], qh[32], qs[128]; } BlockQ5_K;
typedef struct { uint8_t ql[128], qh[64]; int8_t scales[16]; uint8_t d[2]; } BlockQ6_K;
typedef struct { uint8_t e, qs[QK / 2]; } BlockMXFP4; /* w = 2^(e - 128) MXFP4_VALUES[nibble]: OCP MX, doubled */
_Static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "ggml's block_q4_0, block_q4_1");
_Static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "ggml's block_q5_0, block_q5_1");
_Static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockMXFP4) == 17, "ggml's block_q8_0, block_mxfp4");

/* E2M1's sixteen values, doubled (ggml's kvalues_mxfp4): the scale below halves them back. */
static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An E8M0 scale, halved (ggml's ggml_e8m0_to_fp32_half): 2^(e - 128), subnormal below e = 2. */
static inline float e8m0_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
_Static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "ggml's K-quants");
_Static_assert(offsetof(BlockQ5_K, qs) == 48 && offsetof(BlockQ6_K, scales) == 192 && offsetof(BlockQ6_K, d) == 208,
               "ggml's K-quant fields");

/* Bytes of one block of block_values(type) values (0: a type not served). */
static inline int block_bytes(int type) {
    switch (type) {
        case Q4_0: return sizeof(BlockQ4_0);
        case Q4_1: return sizeof(BlockQ4_1);
        case Q5_0: return sizeof(BlockQ5_0);
        case Q5_1: return sizeof(BlockQ5_1);
        case Q8_0: return sizeof(BlockQ8_0);
        case Q4_K: return sizeof(BlockQ4_K);
        case Q5_K: return sizeof(BlockQ5_K);
        case Q6_K: return sizeof(BlockQ6_K);
        case MXFP4: return sizeof(BlockMXFP4);
        case F32: return QK * sizeof(float);
        case F16: return QK * sizeof(uint16_t);
        case BF16: return QK * sizeof(uint16_t);
        default: return 0;
    }
}

static inline int is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

static inline int block_values(int type) { return is_k_quant(type) ? 256 : QK; }

static inline int64_t row_bytes(int type, int64_t in_dim) {
    return in_dim / block_values(type) * block_bytes(type);
}


static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The fields the 32-value types share, wherever each type keeps them (Q4_1 and Q5_1 add a min after d). */
static inline const uint8_t *q4_nibbles(int type, const uint8_t *b) {
    return type == Q4_1 ? ((const BlockQ4_1 *)b)->qs : ((const BlockQ4_0 *)b)->qs;
}
static inline const uint8_t *q5_nibbles(int type, const uint8_t *b) {
    return type == Q5_1 ? ((const BlockQ5_1 *)b)->qs : ((const BlockQ5_0 *)b)->qs;
}
static inline const uint8_t *q5_fifth_bits(int type, const uint8_t *b) {
    return type == Q5_1 ? ((const BlockQ5_1 *)b)->qh : ((const BlockQ5_0 *)b)->qh;
}

/* One block -> 32 floats. */
static inline void dequant_block(int type, const uint8_t *b, float *out) {
    if (type == F32) {
        memcpy(out, b, QK * sizeof(float));
        return;
    }
    if (type == BF16 || type == F16) {
        for (int j = 0; j < QK; j++) {
            const uint16_t h = read_u16(b + 2 * j);
            if (type == F16) {
                out[j] = half_to_float(h);
            } else {
                out[j] = bf16_to_float(h);
            }
        }
        return;
    }
    if (type == MXFP4) { /* value j is qs[j]'s low nibble, value j + 16 its high one, as Q4_0 */
        const float d = e8m0_scale(((const BlockMXFP4 *)b)->e);
        const uint8_t *q = ((const BlockMXFP4 *)b)->qs;
        for (int j = 0; j < QK / 2; j++) {
            out[j] = d * MXFP4_VALUES[q[j] & 0x0f];
            out[j + QK / 2] = d * MXFP4_VALUES[q[j] >> 4];
        }
        return;
    }
    const float d = half_at(b); /* every other 32-value type's scale comes first */
    if (type == Q8_0) {
        const int8_t *q = ((const BlockQ8_0 *)b)->qs;
        for (int j = 0; j < QK; j++) out[j] = d * (float)q[j];
    } else if (type == Q4_1) {
        const float m = half_at(((const BlockQ4_1 *)b)->m);
        const uint8_t *q = ((const BlockQ4_1 *)b)->qs;
        for (int j = 0; j < QK / 2; j++) {
            out[j] = d * (float)(q[j] & 0x0f) + m;
            out[j + QK / 2] = d * (float)(q[j] >> 4) + m;
        }
    } else if (type == Q5_0 || type == Q5_1) { /* value j's fifth bit is bit j of qh */
        const int q51 = type == Q5_1;
        const float m = q51 ? half_at(((const BlockQ5_1 *)b)->m) : 0.0f;
        uint32_t qh;
        memcpy(&qh, q5_fifth_bits(type, b), 4);
        const uint8_t *q = q5_nibbles(type, b);
        for (int j = 0; j < QK / 2; j++) {
            const int u0 = (q[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
            const int u1 = (q[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1) << 4);
            out[j] = q51 ? d * (float)u0 + m : d * (float)(u0 - 16);
            out[j + QK / 2] = q51 ? d * (float)u1 + m : d * (float)(u1 - 16);
        }
    } else {  /* Q4_0 */
        const uint8_t *q = ((const BlockQ4_0 *)b)->qs;
        for (int j = 0; j < QK / 2; j++) {
            out[j] = d * (float)((int)(q[j] & 0x0f) - 8);
            out[j + QK / 2] = d * (float)((int)(q[j] >> 4) - 8);
        }
    }
}

/* Q4_K: the 6-bit scale and min of sub-block j, packed in 12 bytes as ggml packs them. */
static inline void q4k_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Where sub-block sb's values of a K-quant block live. Q4_K: sub-block s is the low (s even) or high (s odd)
   nibbles of qs[32 (s / 2) ..], value d sc q - dmin m with its own 6-bit sc and m. Q5_K: as Q4_K, each value's
   fifth bit the bit s of qh[j]. Q6_K: sub-block s = 4n + k of half n takes the low (k < 2) or high nibbles of
   ql[64n + 32 (k & 1) ..] and bits 2k of qh[32n ..], value d scale (q - 32), a scale per 16 values. */
typedef struct {
    const uint8_t *q, *qh;
    float scale[2], offset;
    int shift, hshift;
} KSub;

static inline KSub k_sub(int type, const uint8_t *wrow, int64_t sb) {
    KSub k;
    const int s = (int)(sb & 7);
    if (type == Q4_K || type == Q5_K) { /* Q5_K is Q4_K's layout with the fifth bits before the nibbles */
        const uint8_t *b = wrow + (sb >> 3) * block_bytes(type);
        const BlockQ4_K *b4 = (const BlockQ4_K *)b;
        int sc, m;
        q4k_scale_min(b4->scales, s, &sc, &m);
        k.scale[0] = k.scale[1] = half_at(b4->d) * (float)sc;
        k.offset = half_at(b4->dmin) * (float)m;
        k.q = (type == Q4_K ? b4->qs : ((const BlockQ5_K *)b)->qs) + 32 * (s >> 1);
        k.qh = type == Q5_K ? ((const BlockQ5_K *)b)->qh : 0;
        k.shift = (s & 1) * 4;
        k.hshift = s;
    } else { /* Q6_K */
        const BlockQ6_K *b = (const BlockQ6_K *)wrow + (sb >> 3);
        const int n = s >> 2, j = s & 3;
        const int8_t *sc = b->scales + 8 * n + 2 * j;
        const float d = half_at(b->d);
        k.scale[0] = d * (float)sc[0];
        k.scale[1] = d * (float)sc[1];
        k.offset = 0.0f;
        k.q = b->ql + 64 * n + (j & 1) * 32;
        k.qh = b->qh + 32 * n;
        k.shift = (j >> 1) * 4;
        k.hshift = 2 * j;
    }
    return k;
}

/* Sub-block sb (values 32 sb .. 32 sb + 31) of a weight row -> 32 floats, as ggml dequantizes them. */
static inline void dequant_sub(int type, const uint8_t *wrow, int64_t sb, float *out) {
    if (is_k_quant(type)) {
        const KSub k = k_sub(type, wrow, sb);
        for (int j = 0; j < QK; j++) {
            const int nib = (k.q[j] >> k.shift) & 15;
            if (type == Q4_K)
                out[j] = k.scale[0] * (float)nib - k.offset;
            else if (type == Q5_K)
                out[j] = k.scale[0] * (float)(nib | (((k.qh[j] >> k.hshift) & 1) << 4)) - k.offset;
            else
                out[j] = k.scale[j >> 4] * (float)((nib | (((k.qh[j] >> k.hshift) & 3) << 4)) - 32);
        }
        return;
    }
    dequant_block(type, wrow + sb * block_bytes(type), out);
}

#if defined(__AVX512F__)
/* One block -> two vectors of 16 floats (values 0-15, 16-31). */
static inline void dequant_block_512(int type, const uint8_t *b, __m512 *lo, __m512 *hi) {
    if (type == F32) {
        *lo = _mm512_loadu_ps((const float *)b);
        *hi = _mm512_loadu_ps((const float *)b + 16);
        return;
    }
    if (type == BF16) {
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16));
        *hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32))), 16));
        return;
    }
    if (type == F16) {
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        return;
    }
    if (type == MXFP4) { /* the block's 16 values as one vector, each nibble an index (as Q4_0 below) */
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(e8m0_scale(((const BlockMXFP4 *)b)->e)),
                                           _mm512_loadu_ps(MXFP4_VALUES));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const BlockMXFP4 *)b)->qs));
        *lo = _mm512_permutexvar_ps(q, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        return;
    }
    const __m512 d = _mm512_set1_ps(half_at(b)); /* unused by Q4_1: the compiler drops it */
    if (type == Q8_0) {
        const int8_t *q = ((const BlockQ8_0 *)b)->qs;
        __m128i q0 = _mm_loadu_si128((const __m128i *)q);
        __m128i q1 = _mm_loadu_si128((const __m128i *)(q + 16));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    if (type == Q5_0 || type == Q5_1) { /* 32 possible values: a table of two vectors, each value's index its
                                           nibble and fifth bit (vpermt2ps reads 5 bits) */
        const int q51 = type == Q5_1;
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 sixteen = _mm512_set1_ps(16.0f);
        __m512 t0, t1;
        if (q51) {
            const __m512 m = _mm512_set1_ps(half_at(((const BlockQ5_1 *)b)->m));
            t0 = _mm512_fmadd_ps(d, iota, m);
            t1 = _mm512_fmadd_ps(d, _mm512_add_ps(iota, sixteen), m);
        } else {
            t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, sixteen));
            t1 = _mm512_mul_ps(d, iota);
        }
        uint32_t qh;
        memcpy(&qh, q5_fifth_bits(type, b), 4);
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i h = _mm512_set1_epi32((int)qh), one = _mm512_set1_epi32(1);
        const __m512i h0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, lane), one), 4);
        const __m512i h1 = _mm512_slli_epi32(
            _mm512_and_si512(_mm512_srlv_epi32(h, _mm512_add_epi32(lane, _mm512_set1_epi32(16))), one), 4);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q5_nibbles(type, b)));
        *lo = _mm512_permutex2var_ps(t0, _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(15)), h0), t1);
        *hi = _mm512_permutex2var_ps(t0, _mm512_or_si512(_mm512_srli_epi32(q, 4), h1), t1);
        return;
    }
    /* Q4_0 / Q4_1: the block's 16 possible values as one vector (d * q + m, or d * (q - 8)), and each
       nibble looks its value up there (vpermps reads an index's low 4 bits, so the low nibbles need no
       mask): a third of the vector work of converting every nibble to a float and scaling it, with the
       same values — the table entry is the same multiply-add of the same operands. */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if (type == Q4_1) {
        uint32_t dm;
        memcpy(&dm, b, 4); /* Q4_1's d and m */
        const __m512 v = _mm512_cvtph_ps(_mm256_set1_epi32((int)dm)); /* d, m, d, m, ... */
        table = _mm512_fmadd_ps(_mm512_permute_ps(v, 0x00), iota, _mm512_permute_ps(v, 0x55));
    } else {
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q4_nibbles(type, b)));
    *lo = _mm512_permutexvar_ps(q, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

/* Sub-block sb of a weight row -> two vectors of 16 floats, the same values as dequant_sub. */
static inline void dequant_sub_512(int type, const uint8_t *wrow, int64_t sb, __m512 *lo, __m512 *hi) {
    if (!is_k_quant(type)) {
        dequant_block_512(type, wrow + sb * block_bytes(type), lo, hi);
        return;
    }
    const KSub k = k_sub(type, wrow, sb);
    const __m512i shift = _mm512_set1_epi32(k.shift), fifteen = _mm512_set1_epi32(15);
    __m512i a = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k.q)), shift),
                                 fifteen);
    __m512i c = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.q + 16))), shift), fifteen);
    if (type == Q4_K) { /* 16 values: a table, each nibble an index (d * sc * q - dmin * m, rounded as ggml) */
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(k.scale[0]), iota), _mm512_set1_ps(k.offset));
        *lo = _mm512_permutexvar_ps(a, table);
        *hi = _mm512_permutexvar_ps(c, table);
        return;
    }
    const __m512i hshift = _mm512_set1_epi32(k.hshift);
    if (type == Q5_K) { /* the fifth bit from qh, then d * sc * u - dmin * m */
        const __m512i one = _mm512_set1_epi32(1);
        const __m512i h0 = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k.qh)), hshift), one);
        const __m512i h1 = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.qh + 16))), hshift), one);
        a = _mm512_or_si512(a, _mm512_slli_epi32(h0, 4));
        c = _mm512_or_si512(c, _mm512_slli_epi32(h1, 4));
        const __m512 sc = _mm512_set1_ps(k.scale[0]), off = _mm512_set1_ps(k.offset);
        *lo = _mm512_sub_ps(_mm512_mul_ps(sc, _mm512_cvtepi32_ps(a)), off);
        *hi = _mm512_sub_ps(_mm512_mul_ps(sc, _mm512_cvtepi32_ps(c)), off);
        return;
    }
    const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
    const __m512i h0 = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k.qh)), hshift), three);
    const __m512i h1 = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.qh + 16))), hshift), three);
    a = _mm512_sub_epi32(_mm512_or_si512(a, _mm512_slli_epi32(h0, 4)), bias);
    c = _mm512_sub_epi32(_mm512_or_si512(c, _mm512_slli_epi32(h1, 4)), bias);
    *lo = _mm512_mul_ps(_mm512_set1_ps(k.scale[0]), _mm512_cvtepi32_ps(a));
    *hi = _mm512_mul_ps(_mm512_set1_ps(k.scale[1]), _mm512_cvtepi32_ps(c));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
/* Sub-block sb of a weight row -> four vectors of 8 floats (values 0-7, ..., 24-31), the same values as
   dequant_sub: Q8_0, MXFP4 (a magnitude table of 8 and the nibble's sign bit) and plain fp32 rows in
   registers, the rest through dequant_sub (half-width rows have their own kernel: widened_rows.h). AVX2 machines multiply 4-6 bit types packed
   (packed_blocks.h); Q8_0 (its packed kernel would saturate AVX2's byte products) and what does not pack
   come here. */
static inline void dequant_sub_256(int type, const uint8_t *wrow, int64_t sb, __m256 v[4]) {
    if (type == Q8_0) {
        const BlockQ8_0 *b = (const BlockQ8_0 *)(wrow + sb * sizeof(BlockQ8_0));
        const __m256 d = _mm256_set1_ps(half_at(b->d));
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * k)))));
    } else if (type == MXFP4) { /* value j: qs[j]'s low nibble, j + 16 its high one; bit 3 the sign */
        const BlockMXFP4 *b = (const BlockMXFP4 *)(wrow + sb * sizeof(BlockMXFP4));
        const __m256 table = _mm256_mul_ps(_mm256_set1_ps(e8m0_scale(b->e)), _mm256_loadu_ps(MXFP4_VALUES));
        const __m128i q = _mm_loadu_si128((const __m128i *)b->qs), f = _mm_set1_epi8(0x0f);
        const __m128i half[2] = {_mm_and_si128(q, f), _mm_and_si128(_mm_srli_epi16(q, 4), f)};
        for (int k = 0; k < 4; k++) {
            const __m256i n = _mm256_cvtepu8_epi32(k & 1 ? _mm_srli_si128(half[k >> 1], 8) : half[k >> 1]);
            const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(n, 3), 31));
            v[k] = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, n), sign);
        }
    } else if (type == F32) {
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps((const float *)wrow + sb * QK + 8 * k);
    } else { /* BF16 and F16 rows never come here: widened_rows.h */
        float w[QK];
        dequant_sub(type, wrow, sb, w);
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(w + 8 * k);
    }
}
#endif

/* How far ahead of the block being read a weight row is asked for (bytes). A decode step's matmuls stream
   every weight once, and the hardware prefetcher alone left the dot products waiting on memory: asking for
   the lines a few KB ahead made the one-row LM head (Q8_0) ~20% and the Q4_1 layers ~7% faster with cold
   caches (same arithmetic; a prefetch past a row's end is only a hint, it never faults). */
#define PREFETCH_AHEAD 4096

static inline __attribute__((always_inline)) void prefetch_sub(int type, const uint8_t *wrow, int64_t sb) {
    /* the sub-block's byte offset (a K-quant's 32-value sub-blocks share its 144, 176 or 210 bytes) */
    const uint8_t *p = wrow + sb * block_bytes(type) * QK / block_values(type) + PREFETCH_AHEAD;
    __builtin_prefetch(p, 0, 3);
    if (type == F32) __builtin_prefetch(p + 64, 0, 3); /* 128 bytes a sub-block */
}

#include "widened_rows.h"

/* y[r, o] for rows r0 .. r0 + nr - 1 (nr <= ROWS) of one output row o (nblocks: its 32-value sub-blocks). Inlined with nr a constant (see
   rows_dot), so the accumulators live in registers: two per row (a block's low and high halves), so
   consecutive FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void rows_dot_n(int type, const uint8_t *wrow, int64_t nblocks,
                                                              const float *x, int64_t in_dim, const int nr,
                                                              float *acc_out) {
#if defined(__AVX512F__)
    __m512 acc_lo[ROWS], acc_hi[ROWS];
    for (int r = 0; r < nr; r++) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; blk++) {
        __m512 lo, hi;
        prefetch_sub(type, wrow, blk);
        dequant_sub_512(type, wrow, blk, &lo, &hi);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * in_dim + blk * QK;
            acc_lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), lo, acc_lo[r]);
            acc_hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, acc_hi[r]);
        }
    }
    for (int r = 0; r < nr; r++) acc_out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
#elif defined(QUANT_AVX2)
    /* the portable loop's arithmetic (below) exactly: 32 sums a row, one per value of a block, each a
       product rounded then added, summed in order at the end; only the dequantizing is in registers */
    __m256 acc[ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < 4; k++) acc[r][k] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; blk++) {
        __m256 w[4];
        prefetch_sub(type, wrow, blk);
        dequant_sub_256(type, wrow, blk, w);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * in_dim + blk * QK;
            for (int k = 0; k < 4; k++)
                acc[r][k] = _mm256_add_ps(acc[r][k], _mm256_mul_ps(_mm256_loadu_ps(xr + 8 * k), w[k]));
        }
    }
    for (int r = 0; r < nr; r++) {
        float sums[QK], s = 0.0f;
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(sums + 8 * k, acc[r][k]);
        for (int j = 0; j < QK; j++) s += sums[j];
        acc_out[r] = s;
    }
#else
    float acc[ROWS][QK];
    float w[QK];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < QK; j++) acc[r][j] = 0.0f;
    for (int64_t blk = 0; blk < nblocks; blk++) {
        prefetch_sub(type, wrow, blk);
        dequant_sub(type, wrow, blk, w);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * in_dim + blk * QK;
#pragma omp simd
            for (int j = 0; j < QK; j++) acc[r][j] += xr[j] * w[j];
        }
    }
    for (int r = 0; r < nr; r++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += acc[r][j];
        acc_out[r] = s;
    }
#endif
}

#define ROWS_DOT_CASES(T)                                                                                   \
    switch (nr) { /* one copy per row count, each with its accumulators in registers */                      \
        case 1: rows_dot_n(T, wrow, nblocks, x, in_dim, 1, acc_out); return;                                 \
        case 2: rows_dot_n(T, wrow, nblocks, x, in_dim, 2, acc_out); return;                                 \
        case 3: rows_dot_n(T, wrow, nblocks, x, in_dim, 3, acc_out); return;                                 \
        case 4: rows_dot_n(T, wrow, nblocks, x, in_dim, 4, acc_out); return;                                 \
        case ROWS: rows_dot_n(T, wrow, nblocks, x, in_dim, ROWS, acc_out); return;                           \
        default: /* 5-7: four, then the rest */                                                              \
            rows_dot_n(T, wrow, nblocks, x, in_dim, 4, acc_out);                                             \
            rows_dot(T, wrow, nblocks, x + 4 * in_dim, in_dim, nr - 4, acc_out + 4);                         \
            return;                                                                                          \
    }

/* The dot products of nr <= ROWS rows of x with one weight row, specialized on the type and the row count
   so neither is tested inside the loop over blocks. */
static void rows_dot(int type, const uint8_t *wrow, int64_t nblocks, const float *x, int64_t in_dim, int nr,
                     float *acc_out) {
#if WIDE_ROWS
    if (widened_type(type)) { /* the same answers as the matmuls' passes over several weight rows */
        widened_rows(type, wrow, 0, nblocks * QK, x, in_dim, nr, 1, acc_out, 1);
        return;
    }
#endif
    switch (type) {
        case Q4_0: ROWS_DOT_CASES(Q4_0)
        case Q4_1: ROWS_DOT_CASES(Q4_1)
        case Q5_0: ROWS_DOT_CASES(Q5_0)
        case Q5_1: ROWS_DOT_CASES(Q5_1)
        case Q8_0: ROWS_DOT_CASES(Q8_0)
        case Q4_K: ROWS_DOT_CASES(Q4_K)
        case Q5_K: ROWS_DOT_CASES(Q5_K)
        case Q6_K: ROWS_DOT_CASES(Q6_K)
        case MXFP4: ROWS_DOT_CASES(MXFP4)
        case F16: ROWS_DOT_CASES(F16)
        case BF16: ROWS_DOT_CASES(BF16)
        default: ROWS_DOT_CASES(F32)
    }
}

#endif
