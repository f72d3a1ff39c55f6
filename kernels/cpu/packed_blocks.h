/* Q4_0 / Q4_1 / Q8_0 weights repacked at load for decode: 16 output rows interleaved, activations as 16-bit
   integers.

   A decode step's matmuls read every weight once. On GGUF's own layout each 32-value block of a row is
   dequantized into floats before its multiply-adds (quant_blocks.h), ~6 cycles a block: on a 2-core VM
   that kept the layers at ~11 GB/s where the memory gives ~20. Here 16 rows are interleaved so each 32-bit
   lane of a vector belongs to one output row, and the multiply-adds are integer dot products (AVX-512 VNNI
   `vpdpbusd`: 64 of them an instruction) of the 4-bit weights with the activations rounded to 16-bit
   integers: one scale per 32 activations, amax / 32767 — 2^-16 of the block's largest value, where
   llama.cpp's 8-bit activations (amax / 127) cost a 135M model 1.3% perplexity. A 16-bit activation
   q = 256 hi + lo is two byte dot products (lo unsigned against the weights as signed, the weights as
   unsigned against hi signed). Each block's scale and offset then apply to 16 rows at once.

   Layouts: for each group of 16 rows, for each 32-value block, the 16 rows' blocks rearranged:
     PACKED_Q4 (from Q4_0 / Q4_1), 320 bytes:
       4 x 64 bytes of nibbles: in part k, byte 4 r + t holds row r's value 4k + t (low half) and 16 + 4k + t
                               (high half), r = 0..15, t = 0..3
       16 x fp16 d, then 16 x fp16 m            w = d q + m  (Q4_0 packs as m = -8 d, exact in fp16)
     PACKED_Q5 (from Q5_0 / Q5_1: what K_M files hold where a row is not a multiple of 256 wide), 384 bytes:
       nibbles as PACKED_Q4's, 64 bytes of their fifth bits as PACKED_Q5K's, 16 x fp16 d, 16 x fp16 m
                                                w = d u + m, u = 0..31  (Q5_0 packs as m = -16 d)
     PACKED_Q8 (from Q8_0), 544 bytes:
       8 x 64 bytes of int8: in part k, byte 4 r + t holds row r's value 4k + t
       16 x fp16 d                              w = d q
   A block's contribution to row r is  d_r dx (sum_j q_rj qx_j) + m_r (sum_j x_j): the integer sum is exact,
   the offset term uses the activations' fp32 sum.

   The K-quants keep their 256-value super-blocks, so a packed weight is as small as the file's: per group and
   super-block, a head of the 16 rows' fp32 scales, then its eight 32-value sub-blocks:
     PACKED_Q4K (from Q4_K), 2432 bytes = 128 head (16 x fp32 d, 16 x fp32 dmin) + 8 x 288:
       4 x 64 bytes of nibbles as PACKED_Q4's, 16 x u8 sc, 16 x u8 m   w = (d sc) q - (dmin m)
     PACKED_Q5K (from Q5_K), 2944 bytes = 128 head (as Q4K's) + 8 x 352: 4 x 64 bytes of the values' low
       nibbles as PACKED_Q4's, 64 bytes of their fifth bits (byte 4 r + t: bit 2k for value 4k + t, bit 2k + 1
       for 16 + 4k + t), 16 x u8 sc, 16 x u8 m                        w = (d sc) u - (dmin m), u = 0..31
     PACKED_Q6K (from Q6_K), 3392 bytes = 64 head (16 x fp32 d) + 8 x 416:
       4 x 64 bytes of the values' low nibbles as PACKED_Q4's; 2 x 64 bytes of their high 2-bit pairs (in part
       p, byte 4 r + t holds, two bits each from bit 0: the high bits of values 8p + t, 16 + 8p + t, 8p + 4 + t,
       20 + 8p + t); 16 x i8 scale of values 0-15, 16 x i8 of 16-31     w = (d sc) (u - 32), u = 0..63
   All multiply as PACKED_Q4 does (unsigned weights, 16-bit activations); Q4_K's and Q5_K's offset meets the sub-block's
   activation sum, Q6_K's -32 (d sc) the sums of its two 16-value halves, each with its own scale.
     PACKED_MX4 (from MXFP4: gpt-oss's experts), 272 bytes (the file's 17 a row):
       4 x 64 bytes of nibbles as PACKED_Q4's, each an index into E2M1's values, 16 x u8 E8M0 exponent e
                                               w = d (u - 12), d = 2^(e - 128), u = MX4_UNSIGNED[nibble]
     a byte shuffle turns each nibble into u = its doubled value + 12 (0..24) before the dot products, which then
     run as PACKED_Q4's with m = -12 d; d is e shifted into a float's exponent. */
#ifndef PAGEDSERVE_PACKED_BLOCKS_H
#define PAGEDSERVE_PACKED_BLOCKS_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#define PACKED_Q4 100 /* the type ids the kernels know the packed layouts by (not ggml types) */
#define PACKED_Q8 101
#define PACKED_Q4K 102
#define PACKED_Q6K 103
#define PACKED_Q5K 104
#define PACKED_MX4 105
#define PACKED_Q5 106
#define PACK_ROWS 16
#define QK_K 256

/* The layouts above as structs. Each starts with its 4-bit values, the 16 rows' nibbles interleaved (part k,
   byte 4 r + t), so a pointer to any of them is one to its PackedNibbles. */
typedef struct { uint8_t q[4][64]; } PackedNibbles;
typedef struct { PackedNibbles nib; uint16_t d[PACK_ROWS], m[PACK_ROWS]; } PackedQ4Block; /* fp16 d, m */
typedef struct { PackedNibbles nib; uint8_t qh[64]; uint16_t d[PACK_ROWS], m[PACK_ROWS]; } PackedQ5Block;
typedef struct { int8_t q[8][64]; uint16_t d[PACK_ROWS]; } PackedQ8Block;
typedef struct { float d[PACK_ROWS], dmin[PACK_ROWS]; } PackedKHead;   /* a Q4_K / Q5_K super-block's */
typedef struct { float d[PACK_ROWS]; } PackedQ6KHead;
typedef struct { PackedNibbles nib; uint8_t sc[PACK_ROWS], m[PACK_ROWS]; } PackedQ4KSub;
typedef struct { PackedNibbles nib; uint8_t qh[64], sc[PACK_ROWS], m[PACK_ROWS]; } PackedQ5KSub;
typedef struct { PackedNibbles nib; uint8_t qh[2][64]; int8_t sc[2][PACK_ROWS]; } PackedQ6KSub;
typedef struct { PackedNibbles nib; uint8_t e[PACK_ROWS]; } PackedMX4Block;
_Static_assert(sizeof(PackedQ4Block) == 320 && sizeof(PackedQ8Block) == 544, "PACKED_Q4, PACKED_Q8");
_Static_assert(sizeof(PackedMX4Block) == 272 && sizeof(PackedQ5Block) == 384, "PACKED_MX4, PACKED_Q5");
_Static_assert(sizeof(PackedKHead) + 8 * sizeof(PackedQ4KSub) == 2432, "PACKED_Q4K");
_Static_assert(sizeof(PackedKHead) + 8 * sizeof(PackedQ5KSub) == 2944, "PACKED_Q5K");
_Static_assert(sizeof(PackedQ6KHead) + 8 * sizeof(PackedQ6KSub) == 3392, "PACKED_Q6K");
_Static_assert(offsetof(PackedKHead, d) == offsetof(PackedQ6KHead, d), "every K head starts with its d");

/* bytes of a group's 32-value block; for the K-quants an eighth of a super-block (head included), so
   nblocks * pack_block_bytes spans a group as well */
static inline int pack_block_bytes(int ptype) {
    switch (ptype) {
        case PACKED_Q4: return sizeof(PackedQ4Block);
        case PACKED_Q5: return sizeof(PackedQ5Block);
        case PACKED_MX4: return sizeof(PackedMX4Block);
        case PACKED_Q8: return sizeof(PackedQ8Block);
        case PACKED_Q4K: return (sizeof(PackedKHead) + 8 * sizeof(PackedQ4KSub)) / 8;
        case PACKED_Q6K: return (sizeof(PackedQ6KHead) + 8 * sizeof(PackedQ6KSub)) / 8;
        case PACKED_Q5K: return (sizeof(PackedKHead) + 8 * sizeof(PackedQ5KSub)) / 8;
        default: return 0;
    }
}
static inline int packed_type(int32_t type) { return pack_block_bytes(type) > 0; }
static inline int packed_is_k(int ptype) { return ptype == PACKED_Q4K || ptype == PACKED_Q5K || ptype == PACKED_Q6K; }
/* the 32-value layouts that start with PackedNibbles and carry an offset per row and block (Q5's a fifth bit) */
static inline int packed_is_q4(int ptype) { return ptype == PACKED_Q4 || ptype == PACKED_MX4 || ptype == PACKED_Q5; }
/* PACKED_Q4's and PACKED_Q5's fp16 scales and offsets, wherever each keeps them */
static inline const uint16_t *packed_q4_d(int ptype, const void *blk) {
    return ptype == PACKED_Q5 ? ((const PackedQ5Block *)blk)->d : ((const PackedQ4Block *)blk)->d;
}
static inline const uint16_t *packed_q4_m(int ptype, const void *blk) {
    return ptype == PACKED_Q5 ? ((const PackedQ5Block *)blk)->m : ((const PackedQ4Block *)blk)->m;
}
/* A 32-value block's fifth bit of row value j (0..31) in a PACKED_Q5 / PACKED_Q5K qh: byte 4 r + t holds bit 2k
   for value 4k + t and bit 2k + 1 for 16 + 4k + t. */
static inline int packed_fifth(const uint8_t *qh, int r, int j) {
    const int hi = j >> 4, k = (j & 15) >> 2, t = j & 3;
    return (qh[4 * r + t] >> (2 * k + hi)) & 1;
}

/* MXFP4's nibble -> its doubled E2M1 value + 12, unsigned (the packed kernels' byte shuffle table) */
static const int8_t MX4_UNSIGNED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* Whether the kernels' 2^(e - 128) (e's bits as a float's exponent, halved) is e8m0_scale for every block of
   an MXFP4 matrix: not for e = 255 (NaN), nor e = 0 (2^-128 there, 0 here) unless its values are all 0. */
static inline int mx4_packable(const uint8_t *w, int64_t nblocks_total) {
    for (int64_t i = 0; i < nblocks_total; i++) {
        const BlockMXFP4 *b = (const BlockMXFP4 *)(w + i * sizeof(BlockMXFP4));
        if (b->e == 255) return 0;
        for (int j = 0; b->e == 0 && j < QK / 2; j++)
            if (b->qs[j] & 0x77) return 0;
    }
    return 1;
}

/* A packed K super-block's sub-block sb (head: the super-block's first byte). */
static inline const uint8_t *packed_k_sub_at(int ptype, const uint8_t *head, int sb) {
    if (ptype == PACKED_Q6K) return (const uint8_t *)((const PackedQ6KSub *)(head + sizeof(PackedQ6KHead)) + sb);
    if (ptype == PACKED_Q5K) return (const uint8_t *)((const PackedQ5KSub *)(head + sizeof(PackedKHead)) + sb);
    return (const uint8_t *)((const PackedQ4KSub *)(head + sizeof(PackedKHead)) + sb);
}
static inline int packed_k_sub_bytes(int ptype) {
    return ptype == PACKED_Q4K ? sizeof(PackedQ4KSub) : ptype == PACKED_Q5K ? sizeof(PackedQ5KSub) : sizeof(PackedQ6KSub);
}
/* Q4_K's and Q5_K's 6-bit scales and mins of the 16 rows */
static inline const uint8_t *packed_k_scales(int ptype, const uint8_t *sub) {
    return ptype == PACKED_Q5K ? ((const PackedQ5KSub *)sub)->sc : ((const PackedQ4KSub *)sub)->sc;
}
static inline const uint8_t *packed_k_mins(int ptype, const uint8_t *sub) {
    return ptype == PACKED_Q5K ? ((const PackedQ5KSub *)sub)->m : ((const PackedQ4KSub *)sub)->m;
}
#define PACK_XROWS 4         /* activation rows per pass over a group's weights (accumulators in registers) */
#define PACK_TILE 32         /* the most rows a caller hands packed_group_dot at once */
/* From these rows on, AVX2's 8-bit kernels take them as one tile (Q5_K's and Q5's high bits and MXFP4's
   shuffle make their tiles slower than the four-row kernel at 3-4 rows: docs/BENCHMARKS.md). */
static inline int64_t pack_tile_min(int ptype) {
    return ptype == PACKED_Q5K || ptype == PACKED_Q5 || ptype == PACKED_MX4 ? 5 : 3;
}

/* Activations of a matmul as the packed kernel reads them: per row and 32-value block, the 16-bit integers
   split into their low (unsigned) and high (signed) bytes, the scale, and the block's fp32 sum. */
typedef struct {
    uint8_t *lo;   /* [rows][in_dim] */
    int8_t *hi;    /* [rows][in_dim] */
    float *d;      /* [rows][in_dim / 32] */
    float *sum;    /* [rows][in_dim / 32] */
    int32_t *hsum; /* [rows][in_dim / 32] the block's high bytes summed (Q8: weights offset to unsigned) */
    float *sumh;   /* [rows][in_dim / 32] the fp32 sum of the block's first 16 values (Q6_K's halves) */
    int bits8;     /* 8-bit activations (amax / 127) held as the high bytes, low bytes 0: one byte dot product
                      a weight vector instead of two (llama.cpp's precision, twice the integer throughput) */
    uint16_t *tiles; /* the same x as AMX bf16 tiles for BF16 matrices (amx_bf16.h), where the step has them */
} PackedX;

/* Blocks of padding after each row of PackedX: rows are in_dim + 64 bytes apart (packed_x_pitch), so the 32
   rows of a tile at a power-of-two in_dim do not all fall into the same few L1 sets and evict each other
   between a sub-block's two halves. Every kernel is handed the pitch as its activations' row length. */
#define PACK_X_PAD 2
static inline int64_t packed_x_pitch(int64_t in_dim) { return in_dim + PACK_X_PAD * QK; }

/* Bytes of PackedX storage for rows x in_dim (lo, hi, then the per-block values, 64-byte aligned parts). */
static inline int64_t packed_x_bytes(int64_t rows, int64_t in_dim) {
    const int64_t b = (rows * in_dim + 63) / 64 * 64;
    return 2 * b + 4 * 4 * ((rows * (in_dim / QK) + 15) / 16 * 16);
}

static inline PackedX packed_x_at(void *mem, int64_t rows, int64_t in_dim) {
    const int64_t b = (rows * in_dim + 63) / 64 * 64, f = (rows * (in_dim / QK) + 15) / 16 * 16;
    PackedX p;
    p.lo = (uint8_t *)mem;
    p.hi = (int8_t *)((uint8_t *)mem + b);
    p.d = (float *)((uint8_t *)mem + 2 * b);
    p.sum = p.d + f;
    p.hsum = (int32_t *)(p.sum + f);
    p.sumh = (float *)(p.hsum + f);
    p.bits8 = 0;
    p.tiles = 0;
    return p;
}

static inline PackedX packed_x_rows(PackedX x, int64_t r0, int64_t in_dim) {
    x.lo += r0 * in_dim;
    x.hi += r0 * in_dim;
    x.d += r0 * (in_dim / QK);
    x.sum += r0 * (in_dim / QK);
    x.hsum += r0 * (in_dim / QK);
    x.sumh += r0 * (in_dim / QK);
    return x;
}

/* y[r, o] = x[r] . row o of w for rows o in [o0, o1) of n rows of x (px where w is packed), inside an `omp for`
   (quant_matmul.c; the experts' stages call it too). */
void block_rows(int32_t type, const uint8_t *w, const float *x, PackedX px, int64_t n, int64_t in_dim,
                int64_t out_dim, int64_t o0, int64_t o1, float *y);

#if defined(__AVX2__)
static inline float avx2_hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline int32_t avx2_hsum_i32(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

/* 32 int32 (each in [-128, 255] as the caller keeps them) as 32 bytes in order: signed or unsigned packs,
   whose lane interleave the permute undoes */
static inline __m256i avx2_bytes(const __m256i q[4], int is_unsigned) {
    const __m256i a = is_unsigned ? _mm256_packus_epi32(q[0], q[1]) : _mm256_packs_epi32(q[0], q[1]);
    const __m256i b = is_unsigned ? _mm256_packus_epi32(q[2], q[3]) : _mm256_packs_epi32(q[2], q[3]);
    const __m256i c = is_unsigned ? _mm256_packus_epi16(a, b) : _mm256_packs_epi16(a, b);
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

/* A PACKED_MX4 block's 16 (or 8) scales 2^(e - 128): each e placed in a float's exponent field, then halved
   (exact for e >= 1; e = 0 gives 0, which mx4_packable allows only where the values are 0). */
#if defined(__AVX512F__)
static inline __m512 mx4_scales_512(const uint8_t *e) {
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e)), 23);
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
}
#endif
#if defined(__AVX2__)
static inline __m256 mx4_scales_256(const uint8_t *e) {
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e)), 23);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
}
#endif

/* Block i of the whole activation matrix (rows are contiguous, in_dim a multiple of 32). A NaN or an
   infinity rounds to 0 (an infinite amax gives scale infinity and integers 0), and the block's sum carries it
   into every output through the offset term, NaN where the fp32 product would be NaN or infinite.
   With bits8 the block rounds to 8 bits (q = round(127 x / amax)), kept as the high bytes with d = amax / 127
   / 256 so every kernel's 256 hi + lo arithmetic holds and the low-byte products can be left out; its sums
   are then the rounded values' own, so a weight's offset (Q4_K's min, Q6_K's -32) meets the same activations
   as its integers and the product is the dequantized weight times the rounded activations: against the exact
   sums, the 8-bit rounding error would meet the unsigned integers (0..63) instead of the centred values. */
static inline void packed_x_block(const float *x, PackedX p, int64_t src, int64_t nb) {
    const float *xb = x + src * QK;
    const int64_t i = src / nb * (nb + PACK_X_PAD) + src % nb; /* where block src of its row lands */
    const float top = p.bits8 ? 127.0f : 32767.0f;
    float amax = 0.0f, s = 0.0f, sh = 0.0f;
#if defined(__AVX2__)
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) { /* max_ps returns its second operand for a NaN: NaNs are passed over */
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[k]), m);
    }
    {
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    sh = avx2_hsum(_mm256_add_ps(v[0], v[1]));
    s = sh + avx2_hsum(_mm256_add_ps(v[2], v[3]));
#else
    for (int j = 0; j < QK; j++) {
        amax = fmaxf(amax, fabsf(xb[j]));
        s += xb[j];
        if (j == QK / 2 - 1) sh = s;
    }
#endif
    const float d = amax / top, inv = top / amax;
    const float id = d > 0.0f && isfinite(d) && isfinite(inv) ? inv : 0.0f; /* 0: a block of zeros (or ~1e-38) */
    int32_t hs = 0, qs = 0, qsh = 0;
#if defined(__AVX2__)
    __m256i q[4], hi[4], lo[4];
    for (int k = 0; k < 4; k++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q)); /* NaN (an infinity times 0) -> 0 */
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-top)), _mm256_set1_ps(top));
        q[k] = _mm256_cvtps_epi32(r);
        hi[k] = p.bits8 ? q[k] : _mm256_srai_epi32(q[k], 8);
        lo[k] = p.bits8 ? _mm256_setzero_si256() : _mm256_and_si256(q[k], _mm256_set1_epi32(255));
    }
    _mm256_storeu_si256((__m256i *)(p.hi + i * QK), avx2_bytes(hi, 0));
    _mm256_storeu_si256((__m256i *)(p.lo + i * QK), avx2_bytes(lo, 1));
    hs = avx2_hsum_i32(_mm256_add_epi32(_mm256_add_epi32(hi[0], hi[1]), _mm256_add_epi32(hi[2], hi[3])));
    qsh = avx2_hsum_i32(_mm256_add_epi32(q[0], q[1]));
    qs = qsh + avx2_hsum_i32(_mm256_add_epi32(q[2], q[3]));
#else
    for (int j = 0; j < QK; j++) {
        float v = nearbyintf(xb[j] * id);
        v = v > top ? top : (v < -top ? -top : v);
        const int q = v == v ? (int)v : 0, hi = p.bits8 ? q : (q - (q & 255)) / 256;
        p.lo[i * QK + j] = p.bits8 ? 0 : (uint8_t)(q & 255);
        p.hi[i * QK + j] = (int8_t)hi;
        hs += hi;
        qs += q;
        if (j == QK / 2 - 1) qsh = qs;
    }
#endif
    const int rounded = p.bits8 && isfinite(s) && id > 0.0f;
    p.d[i] = p.bits8 ? d * (1.0f / 256.0f) : d;
    p.sum[i] = rounded ? (float)qs * d : s;
    p.hsum[i] = hs;
    p.sumh[i] = rounded ? (float)qsh * d : sh;
}

/* The four activation words one part of a 32-value block meets (values 4k..4k+3 and 16+4k..16+4k+3 at `at`
   = row start + block start + 4k): their low bytes, then their high bytes, each four bytes as one word. */
static inline void x_words(PackedX x, int64_t at, int32_t *l0, int32_t *l1, int32_t *h0, int32_t *h1) {
    memcpy(l0, x.lo + at, 4);
    memcpy(l1, x.lo + at + 16, 4);
    memcpy(h0, x.hi + at, 4);
    memcpy(h1, x.hi + at + 16, 4);
}


/* Rows [16 g0, 16 (g0 + n)) of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / MXFP4 matrix -> n packed groups. */
static inline void pack_groups(const uint8_t *w, int type, int64_t nblocks, int64_t g0, int64_t n, uint8_t *out) {
    const int bb = block_bytes(type);
    const int q5 = type == Q5_0 || type == Q5_1;
    const int pb =
        pack_block_bytes(type == Q8_0 ? PACKED_Q8 : type == MXFP4 ? PACKED_MX4 : q5 ? PACKED_Q5 : PACKED_Q4);
    for (int64_t g = g0; g < g0 + n; g++)
        for (int64_t b = 0; b < nblocks; b++) {
            uint8_t *dst = out + (g * nblocks + b) * pb;
            for (int r = 0; r < PACK_ROWS; r++) {
                const uint8_t *src = w + ((g * PACK_ROWS + r) * nblocks + b) * bb;
                if (type == MXFP4) { /* the exponent as it is, the nibbles as Q4_0's */
                    PackedMX4Block *pm = (PackedMX4Block *)dst;
                    pm->e[r] = ((const BlockMXFP4 *)src)->e;
                    for (int k = 0; k < 4; k++) memcpy(pm->nib.q[k] + 4 * r, ((const BlockMXFP4 *)src)->qs + 4 * k, 4);
                    continue;
                }
                const uint16_t d = read_u16(src); /* every other 32-value type's scale comes first */
                if (type == Q8_0) { /* part k (of 8): byte 4 r + t is row r's value 4k + t */
                    PackedQ8Block *p8 = (PackedQ8Block *)dst;
                    p8->d[r] = d;
                    for (int k = 0; k < 8; k++) memcpy(p8->q[k] + 4 * r, ((const BlockQ8_0 *)src)->qs + 4 * k, 4);
                    continue;
                }
                if (q5) { /* w = d (u - 16) = d u + m with m = -16 d (pagedserve_pack refuses a d it overflows) */
                    PackedQ5Block *p5 = (PackedQ5Block *)dst;
                    uint32_t qh;
                    memcpy(&qh, q5_fifth_bits(type, src), 4);
                    p5->d[r] = d;
                    p5->m[r] = type == Q5_1 ? read_u16(((const BlockQ5_1 *)src)->m)
                                            : float_to_half(-16.0f * half_to_float(d));
                    for (int k = 0; k < 4; k++) memcpy(p5->nib.q[k] + 4 * r, q5_nibbles(type, src) + 4 * k, 4);
                    for (int t = 0; t < 4; t++) {
                        uint8_t bits = 0;
                        for (int k = 0; k < 4; k++)
                            bits |= (uint8_t)((((qh >> (4 * k + t)) & 1) << (2 * k)) | (((qh >> (16 + 4 * k + t)) & 1) << (2 * k + 1)));
                        p5->qh[4 * r + t] = bits;
                    }
                    continue;
                }
                PackedQ4Block *p4 = (PackedQ4Block *)dst;
                p4->d[r] = d;
                if (type == Q4_1) {
                    p4->m[r] = read_u16(((const BlockQ4_1 *)src)->m);
                } else { /* w = d (q - 8) = d q + m with m = -8 d, exact in fp16 below its overflow */
                    p4->m[r] = float_to_half(-8.0f * half_to_float(d));
                }
                for (int k = 0; k < 4; k++) memcpy(p4->nib.q[k] + 4 * r, q4_nibbles(type, src) + 4 * k, 4);
            }
        }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define PACKED_AVX2 1
/* AVX2 has no byte dot product into 32 bits: maddubs multiplies unsigned by signed bytes and adds pairs into
   16 bits (saturating: every product here stays below it: 2 x 255 x 63 for Q6_K's 6-bit values against the
   activations' low bytes), madd widens the pairs into 32-bit sums. Q8's signed 8-bit weights against the
   low bytes could saturate, so PACKED_Q8 keeps the portable loop for 16-bit activations; against 8-bit ones
   |w| meets x with w's sign (pagedserve_packed_q8_fast). */
static inline __m256i avx2_dot(__m256i acc, __m256i a_u8, __m256i b_s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a_u8, b_s8), _mm256_set1_epi16(1)));
}
/* Against 8-bit activations (|x| <= 127) a maddubs pair sum stays within 2 u 127: Q4's u <= 15 lets all four
   parts' 8 maddubs add in 16 bits (30,480) before one madd widens them, MXFP4's u <= 24 and Q5's u <= 31 two
   parts' (24,384; 31,496). */
#define AVX2_SUMS16(ptype) ((ptype) == PACKED_MX4 || (ptype) == PACKED_Q5 ? 2 : 4)
/* Part k's fifth bits (PACKED_Q5's, PACKED_Q5K's qh) of half hf set into its low and high values' bytes. */
static inline __attribute__((always_inline)) void avx2_fifth_bits(const uint8_t *qh, int k, int hf, __m256i *wl,
                                                                   __m256i *wh) {
    const __m256i one = _mm256_set1_epi8(1);
    const __m256i h = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * hf)), 2 * k);
    *wl = _mm256_or_si256(*wl, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
    *wh = _mm256_or_si256(*wh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
}
/* Part k of half hf (8 of the 16 rows) of a PACKED_Q4 / PACKED_MX4 / PACKED_Q5 group-block as unsigned bytes:
   the low nibbles' values and the high nibbles', MXFP4's through its shuffle, Q5's with their fifth bits. */
static inline __attribute__((always_inline)) void avx2_q4_part(const int ptype, const PackedQ4Block *p4, int k, int hf,
                                                               __m256i *wl, __m256i *wh) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(p4->nib.q[k] + 32 * hf));
    *wl = _mm256_and_si256(raw, nib);
    *wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    if (ptype == PACKED_MX4) {
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX4_UNSIGNED));
        *wl = _mm256_shuffle_epi8(lut, *wl);
        *wh = _mm256_shuffle_epi8(lut, *wh);
    } else if (ptype == PACKED_Q5) {
        avx2_fifth_bits(((const PackedQ5Block *)p4)->qh, k, hf, wl, wh);
    }
}
/* Half hf's scales and offsets (w = d u + m; MXFP4: m = -12 d). */
static inline __attribute__((always_inline)) void avx2_q4_scales(const int ptype, const PackedQ4Block *p4, int hf,
                                                                 __m256 *d, __m256 *m) {
    if (ptype == PACKED_MX4) {
        *d = mx4_scales_256(((const PackedMX4Block *)p4)->e + 8 * hf);
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(-12.0f));
    } else {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(packed_q4_d(ptype, p4) + 8 * hf)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(packed_q4_m(ptype, p4) + 8 * hf)));
    }
}
#endif

/* One packed value: row r's value j of a group-block, as a float (Q4: d q + m; Q8: d q). */
static inline float packed_value(int ptype, const uint8_t *blk, int r, int j) {
    if (ptype == PACKED_Q8) {
        const PackedQ8Block *p8 = (const PackedQ8Block *)blk;
        return half_to_float(p8->d[r]) * (float)p8->q[j / 4][4 * r + j % 4];
    }
    const PackedQ4Block *p4 = (const PackedQ4Block *)blk;
    const int lo = j < 16, jj = lo ? j : j - 16;
    const uint8_t byte = p4->nib.q[jj / 4][4 * r + jj % 4];
    int q = lo ? byte & 15 : byte >> 4;
    if (ptype == PACKED_MX4) return e8m0_scale(((const PackedMX4Block *)blk)->e[r]) * (float)(MX4_UNSIGNED[q] - 12);
    if (ptype == PACKED_Q5) q |= packed_fifth(((const PackedQ5Block *)blk)->qh, r, j) << 4;
    return half_to_float(packed_q4_d(ptype, blk)[r]) * (float)q + half_to_float(packed_q4_m(ptype, blk)[r]);
}

/* out[r * 16 + i] = row i of the group . activation row r, for nr <= PACK_XROWS rows of x.
   Q4: the nibbles are unsigned (lo against them as signed, them against hi). Q8: the weights are signed, so
   the high bytes meet them offset by 128 (w ^ 0x80 as unsigned) and 128 times the high bytes' sum comes off. */
static inline __attribute__((always_inline)) void packed_group_dot_n(const int ptype, const uint8_t *grp,
                                                                      int64_t nblocks, PackedX x, int64_t in_dim,
                                                                      const int nr, const int x8, float *out) {
    const int pb = pack_block_bytes(ptype);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[PACK_XROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *p = grp + b * pb;
        const PackedQ4Block *p4 = (const PackedQ4Block *)p;
        const PackedQ8Block *p8 = (const PackedQ8Block *)p;
        for (int c = 0; c < pb; c += 64) __builtin_prefetch(p + 4096 + c, 0, 3);
        __m512i ilo[PACK_XROWS], ihi[PACK_XROWS];
        for (int r = 0; r < nr; r++) ilo[r] = ihi[r] = _mm512_setzero_si512();
        if (ptype == PACKED_Q8) {
            for (int k = 0; k < 8; k++) {
                const __m512i w = _mm512_loadu_si512((const void *)p8->q[k]), wu = _mm512_xor_si512(w, flip);
                for (int r = 0; r < nr; r++) {
                    const int64_t at = r * in_dim + b * QK + 4 * k;
                    int32_t l, h;
                    memcpy(&l, x.lo + at, 4);
                    memcpy(&h, x.hi + at, 4);
                    if (!x8) ilo[r] = _mm512_dpbusd_epi32(ilo[r], _mm512_set1_epi32(l), w);
                    ihi[r] = _mm512_dpbusd_epi32(ihi[r], wu, _mm512_set1_epi32(h));
                }
            }
        } else {
            for (int k = 0; k < 4; k++) {
                const __m512i raw = _mm512_loadu_si512((const void *)p4->nib.q[k]);
                __m512i wl = _mm512_and_si512(raw, nib), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
                if (ptype == PACKED_MX4) {
                    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX4_UNSIGNED));
                    wl = _mm512_shuffle_epi8(lut, wl);
                    wh = _mm512_shuffle_epi8(lut, wh);
                } else if (ptype == PACKED_Q5) {
                    const __m512i one = _mm512_set1_epi8(1);
                    const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512((const void *)((const PackedQ5Block *)p)->qh), 2 * k);
                    wl = _mm512_or_si512(wl, _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
                    wh = _mm512_or_si512(wh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 1), one), 4));
                }
                for (int r = 0; r < nr; r++) {
                    const int64_t at = r * in_dim + b * QK + 4 * k;
                    int32_t l0, l1, h0, h1;
                    x_words(x, at, &l0, &l1, &h0, &h1);
                    if (!x8) {
                        ilo[r] = _mm512_dpbusd_epi32(ilo[r], _mm512_set1_epi32(l0), wl);
                        ilo[r] = _mm512_dpbusd_epi32(ilo[r], _mm512_set1_epi32(l1), wh);
                    }
                    ihi[r] = _mm512_dpbusd_epi32(ihi[r], wl, _mm512_set1_epi32(h0));
                    ihi[r] = _mm512_dpbusd_epi32(ihi[r], wh, _mm512_set1_epi32(h1));
                }
            }
        }
        const __m512 d = ptype == PACKED_MX4
                             ? mx4_scales_512(((const PackedMX4Block *)p)->e)
                             : _mm512_cvtph_ps(_mm256_loadu_si256(
                                   (const __m256i *)(ptype == PACKED_Q8 ? p8->d : packed_q4_d(ptype, p4))));
        for (int r = 0; r < nr; r++) {
            const int64_t xb = r * (in_dim / QK) + b;
            if (ptype == PACKED_Q8) ihi[r] = _mm512_sub_epi32(ihi[r], _mm512_set1_epi32(128 * x.hsum[xb]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ihi[r], 8), ilo[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.d[xb])), d, acc[r]);
            if (ptype == PACKED_Q4 || ptype == PACKED_Q5)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)packed_q4_m(ptype, p4))),
                                         _mm512_set1_ps(x.sum[xb]), acc[r]);
            if (ptype == PACKED_MX4) acc[r] = _mm512_fmadd_ps(d, _mm512_set1_ps(-12.0f * x.sum[xb]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
#else
#if defined(PACKED_AVX2)
    if (packed_is_q4(ptype) && !x8) { /* a row at a time, both halves of the 16 rows (8 lanes each) in one pass */
        for (int r = 0; r < nr; r++) {
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = 0; b < nblocks; b++) {
                const PackedQ4Block *p4 = (const PackedQ4Block *)(grp + b * pb);
                if (r == 0)
                    for (int c = 0; c < pb; c += 64) __builtin_prefetch((const uint8_t *)p4 + 4096 + c, 0, 3);
                __m256i ilo[2], ihi[2];
                for (int hf = 0; hf < 2; hf++) ilo[hf] = ihi[hf] = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    const int64_t at = r * in_dim + b * QK + 4 * k;
                    int32_t l0, l1, h0, h1;
                    x_words(x, at, &l0, &l1, &h0, &h1);
                    for (int hf = 0; hf < 2; hf++) {
                        __m256i wl, wh;
                        avx2_q4_part(ptype, p4, k, hf, &wl, &wh);
                        ilo[hf] = avx2_dot(avx2_dot(ilo[hf], _mm256_set1_epi32(l0), wl), _mm256_set1_epi32(l1), wh);
                        ihi[hf] = avx2_dot(avx2_dot(ihi[hf], wl, _mm256_set1_epi32(h0)), wh, _mm256_set1_epi32(h1));
                    }
                }
                const int64_t xb = r * (in_dim / QK) + b;
                for (int hf = 0; hf < 2; hf++) {
                    __m256 d, m;
                    avx2_q4_scales(ptype, p4, hf, &d, &m);
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ihi[hf], 8), ilo[hf]));
                    acc[hf] = _mm256_fmadd_ps(_mm256_mul_ps(dot, _mm256_set1_ps(x.d[xb])), d, acc[hf]);
                    acc[hf] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[xb]), acc[hf]);
                }
            }
            _mm256_storeu_ps(out + r * 16, acc[0]);
            _mm256_storeu_ps(out + r * 16 + 8, acc[1]);
        }
        return;
    }
    if (packed_is_q4(ptype)) { /* 8-bit activations: each weight vector decoded once for all nr rows, and the
                                  maddubs pairs summed in 16 bits before one madd widens them (AVX2_SUMS16) */
        const int sums16 = AVX2_SUMS16(ptype);
        const __m256i ones = _mm256_set1_epi16(1);
        __m256 acc[PACK_XROWS][2];
        for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const PackedQ4Block *p4 = (const PackedQ4Block *)(grp + b * pb);
            for (int c = 0; c < pb; c += 64) __builtin_prefetch((const uint8_t *)p4 + 4096 + c, 0, 3);
            for (int hf = 0; hf < 2; hf++) {
                __m256i dot[PACK_XROWS], s16[PACK_XROWS];
                for (int r = 0; r < nr; r++) dot[r] = s16[r] = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    __m256i wl, wh;
                    avx2_q4_part(ptype, p4, k, hf, &wl, &wh);
                    for (int r = 0; r < nr; r++) {
                        int32_t l0, l1, h0, h1;
                        x_words(x, r * in_dim + b * QK + 4 * k, &l0, &l1, &h0, &h1);
                        const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_set1_epi32(h0)),
                                                             _mm256_maddubs_epi16(wh, _mm256_set1_epi32(h1)));
                        s16[r] = k % sums16 ? _mm256_add_epi16(s16[r], two) : two;
                        if (k % sums16 == sums16 - 1) dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(s16[r], ones));
                    }
                }
                __m256 d, m;
                avx2_q4_scales(ptype, p4, hf, &d, &m);
                for (int r = 0; r < nr; r++) { /* the 16-bit path's arithmetic with its low part 0 */
                    const int64_t xb = r * (in_dim / QK) + b;
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_slli_epi32(dot[r], 8));
                    acc[r][hf] = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_set1_ps(x.d[xb])), d, acc[r][hf]);
                    acc[r][hf] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[xb]), acc[r][hf]);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm256_storeu_ps(out + r * 16, acc[r][0]);
            _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]);
        }
        return;
    }
    if (ptype == PACKED_Q8 && x8) { /* signed weights: |w| against x carrying w's sign, so maddubs' pair sums
                                       stay within 2 x 128 x 127 (the high-byte offset of the 16-bit path would not) */
        const __m256i ones = _mm256_set1_epi16(1);
        __m256 acc[PACK_XROWS][2];
        for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const PackedQ8Block *p8 = (const PackedQ8Block *)(grp + b * pb);
            for (int c = 0; c < pb; c += 64) __builtin_prefetch((const uint8_t *)p8 + 4096 + c, 0, 3);
            for (int hf = 0; hf < 2; hf++) {
                __m256i dot[PACK_XROWS];
                for (int r = 0; r < nr; r++) dot[r] = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p8->q[k] + 32 * hf)), aw = _mm256_abs_epi8(w);
                    for (int r = 0; r < nr; r++) {
                        int32_t h;
                        memcpy(&h, x.hi + r * in_dim + b * QK + 4 * k, 4);
                        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(h), w);
                        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                    }
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p8->d + 8 * hf)));
                for (int r = 0; r < nr; r++) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_slli_epi32(dot[r], 8));
                    acc[r][hf] = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_set1_ps(x.d[r * (in_dim / QK) + b])), d, acc[r][hf]);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm256_storeu_ps(out + r * 16, acc[r][0]);
            _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]);
        }
        return;
    }
#endif
    /* the same integer sums and the same scaling, in plain loops the compiler vectorizes (lo = 0 with x8) */
    (void)x8;
    float acc[PACK_XROWS][PACK_ROWS];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) acc[r][i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const PackedQ4Block *p4 = (const PackedQ4Block *)(grp + b * pb);
        const PackedQ8Block *p8 = (const PackedQ8Block *)(grp + b * pb);
        const uint16_t *dw = ptype == PACKED_Q8 ? p8->d : packed_q4_d(ptype, p4);
        for (int r = 0; r < nr; r++) {
            const int64_t at = r * in_dim + b * QK, xb = r * (in_dim / QK) + b;
            int32_t ilo[PACK_ROWS] = {0}, ihi[PACK_ROWS] = {0};
            for (int i = 0; i < PACK_ROWS; i++)
                for (int j = 0; j < QK; j++) {
                    int q;
                    if (ptype == PACKED_Q8) {
                        q = p8->q[j / 4][4 * i + j % 4];
                    } else {
                        const int jj = j < 16 ? j : j - 16;
                        const uint8_t byte = p4->nib.q[jj / 4][4 * i + jj % 4];
                        q = j < 16 ? byte & 15 : byte >> 4;
                        if (ptype == PACKED_MX4) q = MX4_UNSIGNED[q];
                        if (ptype == PACKED_Q5) q |= packed_fifth(((const PackedQ5Block *)p4)->qh, i, j) << 4;
                    }
                    ilo[i] += q * x.lo[at + j];
                    ihi[i] += q * x.hi[at + j];
                }
            for (int i = 0; i < PACK_ROWS; i++) {
                const float dot = (float)(ihi[i] * 256 + ilo[i]);
                const float di = ptype == PACKED_MX4 ? e8m0_scale(((const PackedMX4Block *)p4)->e[i]) : half_to_float(dw[i]);
                acc[r][i] = fmaf(dot * x.d[xb], di, acc[r][i]);
                if (ptype == PACKED_Q4 || ptype == PACKED_Q5)
                    acc[r][i] = fmaf(half_to_float(packed_q4_m(ptype, p4)[i]), x.sum[xb], acc[r][i]);
                if (ptype == PACKED_MX4) acc[r][i] = fmaf(-12.0f * di, x.sum[xb], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) out[r * 16 + i] = acc[r][i];
#endif
}

/* Rows [16 g0, 16 (g0 + n)) of a Q4_K / Q5_K / Q6_K matrix (nsuper super-blocks a row) -> n packed groups. */
static inline void pack_k_groups(const uint8_t *w, int type, int64_t nsuper, int64_t g0, int64_t n, uint8_t *out) {
    const int bb = block_bytes(type), ptype = type == Q4_K ? PACKED_Q4K : type == Q5_K ? PACKED_Q5K : PACKED_Q6K;
    const int64_t supb = 8 * pack_block_bytes(ptype);
    for (int64_t g = g0; g < g0 + n; g++)
        for (int64_t s = 0; s < nsuper; s++) {
            uint8_t *dst = out + (g * nsuper + s) * supb;
            memset(dst, 0, (size_t)supb);
            PackedKHead *head = (PackedKHead *)dst; /* Q6_K's is its d alone */
            for (int r = 0; r < PACK_ROWS; r++) {
                const uint8_t *src = w + ((g * PACK_ROWS + r) * nsuper + s) * bb;
                const BlockQ4_K *b4 = (const BlockQ4_K *)src; /* Q5_K's d, dmin and scales are where Q4_K's are */
                const BlockQ5_K *b5 = (const BlockQ5_K *)src;
                const BlockQ6_K *b6 = (const BlockQ6_K *)src;
                head->d[r] = half_at(type == Q6_K ? b6->d : b4->d);
                if (type != Q6_K) head->dmin[r] = half_at(b4->dmin);
                for (int sb = 0; sb < 8; sb++) {
                    uint8_t u[QK];
                    PackedNibbles *nib;
                    if (type == Q4_K) {
                        int sc, m;
                        q4k_scale_min(b4->scales, sb, &sc, &m);
                        const uint8_t *q = b4->qs + 32 * (sb >> 1);
                        for (int j = 0; j < QK; j++) u[j] = (q[j] >> (4 * (sb & 1))) & 15;
                        PackedQ4KSub *sub = (PackedQ4KSub *)(dst + sizeof(PackedKHead)) + sb;
                        nib = &sub->nib;
                        sub->sc[r] = (uint8_t)sc;
                        sub->m[r] = (uint8_t)m;
                    } else if (type == Q5_K) {
                        int sc, m;
                        q4k_scale_min(b5->scales, sb, &sc, &m);
                        const uint8_t *q = b5->qs + 32 * (sb >> 1);
                        for (int j = 0; j < QK; j++)
                            u[j] = (uint8_t)(((q[j] >> (4 * (sb & 1))) & 15) | (((b5->qh[j] >> sb) & 1) << 4));
                        PackedQ5KSub *sub = (PackedQ5KSub *)(dst + sizeof(PackedKHead)) + sb;
                        nib = &sub->nib;
                        sub->sc[r] = (uint8_t)sc;
                        sub->m[r] = (uint8_t)m;
                        for (int t = 0; t < 4; t++) {
                            uint8_t bits = 0;
                            for (int k = 0; k < 4; k++)
                                bits |= (uint8_t)((((u[4 * k + t] >> 4) & 1) << (2 * k))
                                                  | (((u[16 + 4 * k + t] >> 4) & 1) << (2 * k + 1)));
                            sub->qh[4 * r + t] = bits;
                        }
                    } else {
                        const int nn = sb >> 2, jj = sb & 3;
                        const uint8_t *q = b6->ql + 64 * nn + (jj & 1) * 32, *qh = b6->qh + 32 * nn;
                        for (int j = 0; j < QK; j++)
                            u[j] = (uint8_t)(((q[j] >> ((jj >> 1) * 4)) & 15) | (((qh[j] >> (2 * jj)) & 3) << 4));
                        PackedQ6KSub *sub = (PackedQ6KSub *)(dst + sizeof(PackedQ6KHead)) + sb;
                        nib = &sub->nib;
                        sub->sc[0][r] = b6->scales[8 * nn + 2 * jj];
                        sub->sc[1][r] = b6->scales[8 * nn + 2 * jj + 1];
                        for (int p = 0; p < 2; p++)
                            for (int t = 0; t < 4; t++)
                                sub->qh[p][4 * r + t] =
                                    (uint8_t)((u[8 * p + t] >> 4) | ((u[16 + 8 * p + t] >> 4) << 2)
                                              | ((u[8 * p + 4 + t] >> 4) << 4) | ((u[20 + 8 * p + t] >> 4) << 6));
                    }
                    for (int k = 0; k < 4; k++)
                        for (int t = 0; t < 4; t++)
                            nib->q[k][4 * r + t] = (uint8_t)((u[4 * k + t] & 15) | ((u[16 + 4 * k + t] & 15) << 4));
                }
            }
        }
}

/* Row r's sub-block b of a packed K group (grp: the group's first byte): where it lives, and its scales: value
   j is scale[j / 16] * u_j - offset (Q4_K: one scale, offset dmin m; Q6_K: a scale a half, offset 32 scale). */
static inline const uint8_t *packed_k_sub(int ptype, const uint8_t *grp, int64_t b, int r, float scale[2],
                                          float *offset) {
    const uint8_t *head = grp + (b >> 3) * 8 * pack_block_bytes(ptype);
    const uint8_t *sub = packed_k_sub_at(ptype, head, (int)(b & 7));
    const float d = ((const PackedKHead *)head)->d[r];
    if (ptype != PACKED_Q6K) {
        scale[0] = scale[1] = d * (float)packed_k_scales(ptype, sub)[r];
        *offset = ((const PackedKHead *)head)->dmin[r] * (float)packed_k_mins(ptype, sub)[r];
        return sub;
    }
    scale[0] = d * (float)((const PackedQ6KSub *)sub)->sc[0][r];
    scale[1] = d * (float)((const PackedQ6KSub *)sub)->sc[1][r];
    *offset = 0.0f;
    return sub;
}

/* The unsigned integer of row r's value j in a packed K sub-block (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63). */
static inline int packed_k_u(int ptype, const uint8_t *sub, int r, int j) {
    const int hi = j >> 4, k = (j & 15) >> 2, t = j & 3;
    const uint8_t byte = ((const PackedNibbles *)sub)->q[k][4 * r + t];
    int u = hi ? byte >> 4 : byte & 15;
    if (ptype == PACKED_Q6K) u |= ((((const PackedQ6KSub *)sub)->qh[k >> 1][4 * r + t] >> (4 * (k & 1) + 2 * hi)) & 3) << 4;
    if (ptype == PACKED_Q5K) u |= packed_fifth(((const PackedQ5KSub *)sub)->qh, r, j) << 4;
    return u;
}

/* Row r's value j of 32-value block b of a packed K group, as ggml dequantizes it. */
static inline float packed_k_value(int ptype, const uint8_t *grp, int64_t b, int r, int j) {
    float scale[2], offset;
    const uint8_t *sub = packed_k_sub(ptype, grp, b, r, scale, &offset);
    const int u = packed_k_u(ptype, sub, r, j);
    if (ptype != PACKED_Q6K) return scale[0] * (float)u - offset;
    return scale[j >> 4] * (float)(u - 32);
}

#if defined(PACKED_AVX2)
/* packed_k_group_dot_n on AVX2. Weight vector k of a sub-block's half hf (8 of the 16 rows, 4 values each) as
   unsigned bytes: its first 16 values' in *wl, its last 16 values' in *wh. */
static inline __attribute__((always_inline)) void avx2_k_weights(const int ptype, const uint8_t *sub, int k, int hf,
                                                                  __m256i *wl, __m256i *wh) {
    const __m256i nib = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(((const PackedNibbles *)sub)->q[k] + 32 * hf));
    *wl = _mm256_and_si256(raw, nib);
    *wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    if (ptype == PACKED_Q6K) {
        const __m256i h = _mm256_srli_epi16(
            _mm256_loadu_si256((const __m256i *)(((const PackedQ6KSub *)sub)->qh[k >> 1] + 32 * hf)), 4 * (k & 1));
        *wl = _mm256_or_si256(*wl, _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
        *wh = _mm256_or_si256(*wh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
    } else if (ptype == PACKED_Q5K) {
        avx2_fifth_bits(((const PackedQ5KSub *)sub)->qh, k, hf, wl, wh);
    }
}

/* acc + one activation row's sub-block b of half hf, scaled, from its integer sums: ha / hb the high bytes'
   against the first / last 16 values (their sum alone where the type scales 32 values as one), la / lb the
   low bytes' (zero with 8-bit activations). */
static inline __attribute__((always_inline)) __m256 avx2_k_scaled(const int ptype, const uint8_t *head,
                                                                   const uint8_t *sub, int hf, PackedX x, int64_t xb,
                                                                   __m256i la, __m256i ha, __m256i lb, __m256i hb,
                                                                   __m256 acc) {
    const __m256 d = _mm256_loadu_ps(((const PackedKHead *)head)->d + 8 * hf), dx = _mm256_set1_ps(x.d[xb]);
    if (ptype != PACKED_Q6K) {
        const __m256 dmin = _mm256_loadu_ps(((const PackedKHead *)head)->dmin + 8 * hf);
        const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                  _mm_loadl_epi64((const __m128i *)(packed_k_scales(ptype, sub) + 8 * hf)))));
        const __m256 offset = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                     _mm_loadl_epi64((const __m128i *)(packed_k_mins(ptype, sub) + 8 * hf)))));
        const __m256i hs = _mm256_add_epi32(ha, hb), ls = _mm256_add_epi32(la, lb);
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hs, 8), ls));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dot, dx), scale, acc);
        return _mm256_fnmadd_ps(offset, _mm256_set1_ps(x.sum[xb]), acc);
    }
    const PackedQ6KSub *s6 = (const PackedQ6KSub *)sub;
    const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s6->sc[0] + 8 * hf)))));
    const __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s6->sc[1] + 8 * hf)))));
    const __m256 da = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ha, 8), la));
    const __m256 db = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hb, 8), lb));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(da, dx), s0, acc);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(db, dx), s1, acc);
    acc = _mm256_fnmadd_ps(s0, _mm256_set1_ps(32.0f * x.sumh[xb]), acc);
    return _mm256_fnmadd_ps(s1, _mm256_set1_ps(32.0f * (x.sum[xb] - x.sumh[xb])), acc);
}

/* A sub-block half's scales for 8-bit activations: sc[0] / sc[1] its integer scales as 16-bit pairs (Q4_K,
   Q5_K: one for all 32 values; Q6_K: the first and the last 16 values'), folded into the widening of the 16-bit
   sums, so a row's products arrive as one int32 (exact as a float below 2^24: Q4_K and Q5_K always, Q6_K
   but for extreme blocks, rounded then alike everywhere); d the rows' super-block scales;
   off[0] / off[1] the float offsets (Q4_K, Q5_K: dmin m, off[1] unused; Q6_K: 32 d sc of each half). d is
   256 times the rows' scales: x.d is a 256th of the activations' rounding step (packed_x_block), exactly. */
typedef struct {
    __m256i sc[2];
    __m256 d, off[2];
} Avx2KScales;

static inline __attribute__((always_inline)) Avx2KScales avx2_k_scales8(const int ptype, const uint8_t *head,
                                                                         const uint8_t *sub, int hf) {
    Avx2KScales s;
    s.d = _mm256_loadu_ps(((const PackedKHead *)head)->d + 8 * hf);
    if (ptype != PACKED_Q6K) {
        const __m256 dmin = _mm256_loadu_ps(((const PackedKHead *)head)->dmin + 8 * hf);
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(packed_k_scales(ptype, sub) + 8 * hf)));
        s.sc[0] = s.sc[1] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
        s.off[0] = s.off[1] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                      (const __m128i *)(packed_k_mins(ptype, sub) + 8 * hf)))));
        s.d = _mm256_mul_ps(s.d, _mm256_set1_ps(256.0f));
        return s;
    }
    const PackedQ6KSub *s6 = (const PackedQ6KSub *)sub;
    for (int h = 0; h < 2; h++) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s6->sc[h] + 8 * hf)));
        s.sc[h] = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc, 16));
        s.off[h] = _mm256_mul_ps(_mm256_mul_ps(s.d, _mm256_set1_ps(32.0f)), _mm256_cvtepi32_ps(sc));
    }
    s.d = _mm256_mul_ps(s.d, _mm256_set1_ps(256.0f)); /* x.d is a 256th of the rounding step: exact */
    return s;
}

/* acc + one activation row's sub-block half with 8-bit activations, from dot: its products times the integer
   scales (Avx2KScales.sc), summed. The offsets first, so the products' long chain ends in one fma; every 8-bit
   AVX2 K-quant kernel scales through here, so a row's floats do not depend on how many rows share its step. */
static inline __attribute__((always_inline)) __m256 avx2_k_scaled8(const int ptype, const Avx2KScales *s,
                                                                    __m256i dot, PackedX x, int64_t xb, __m256 acc) {
    const __m256 dd = _mm256_mul_ps(s->d, _mm256_set1_ps(x.d[xb]));
    if (ptype != PACKED_Q6K) {
        acc = _mm256_fnmadd_ps(s->off[0], _mm256_set1_ps(x.sum[xb]), acc);
    } else {
        acc = _mm256_fnmadd_ps(s->off[0], _mm256_set1_ps(x.sumh[xb]), acc);
        acc = _mm256_fnmadd_ps(s->off[1], _mm256_set1_ps(x.sum[xb] - x.sumh[xb]), acc);
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dd, acc);
}

/* 16-bit activations, one row: both halves of the 16 rows in one pass over the group (it streams from
   memory once; the next sub-blocks asked for ahead when `ahead`), the low and high bytes' sums each widened */
static inline __attribute__((always_inline)) void avx2_k_row16(const int ptype, const uint8_t *grp, int64_t nblocks,
                                                                PackedX x, int64_t in_dim, int ahead, float *out) {
    const int64_t supb = 8 * pack_block_bytes(ptype);
    const int subb = packed_k_sub_bytes(ptype);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *head = grp + b / 8 * supb, *sub = packed_k_sub_at(ptype, head, (int)(b % 8));
        if (ahead)
            for (int c = 0; c < subb; c += 64) __builtin_prefetch(sub + 4096 + c, 0, 3);
        __m256i la[2], ha[2], lb[2], hb[2];
        for (int hf = 0; hf < 2; hf++) la[hf] = ha[hf] = lb[hf] = hb[hf] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            int32_t l0, l1, h0, h1;
            x_words(x, b * QK + 4 * k, &l0, &l1, &h0, &h1);
            for (int hf = 0; hf < 2; hf++) {
                __m256i wl, wh;
                avx2_k_weights(ptype, sub, k, hf, &wl, &wh);
                la[hf] = avx2_dot(la[hf], _mm256_set1_epi32(l0), wl);
                lb[hf] = avx2_dot(lb[hf], _mm256_set1_epi32(l1), wh);
                ha[hf] = avx2_dot(ha[hf], wl, _mm256_set1_epi32(h0));
                hb[hf] = avx2_dot(hb[hf], wh, _mm256_set1_epi32(h1));
            }
        }
        for (int hf = 0; hf < 2; hf++) acc[hf] = avx2_k_scaled(ptype, head, sub, hf, x, b, la[hf], ha[hf], lb[hf], hb[hf], acc[hf]);
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

/* 8-bit activations, nr rows at once: each weight vector unpacked once for all of them; a sub-block's two
   halves in turn (the second from L1); each row's products summed in 16 bits two weight vectors at a time
   before one widening: |a| <= 127, so a lane holds at most 8 x 127 x 31 (5-bit) or 4 x 127 x 63 (Q6_K's
   halves apart), below 2^15 */
static inline __attribute__((always_inline)) void avx2_k_rows8(const int ptype, const uint8_t *grp, int64_t nblocks,
                                                                PackedX x, int64_t in_dim, const int nr, float *out) {
    const int64_t supb = 8 * pack_block_bytes(ptype), xb0 = in_dim / QK;
    const int subb = packed_k_sub_bytes(ptype);
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[PACK_XROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *head = grp + b / 8 * supb, *sub = packed_k_sub_at(ptype, head, (int)(b % 8));
        for (int c = 0; c < subb; c += 64) __builtin_prefetch(sub + 4096 + c, 0, 3);
        for (int hf = 0; hf < 2; hf++) {
            const Avx2KScales sc = avx2_k_scales8(ptype, head, sub, hf);
            __m256i h[PACK_XROWS], ta[PACK_XROWS], tb[PACK_XROWS];
            for (int r = 0; r < nr; r++) h[r] = ta[r] = tb[r] = zero;
            for (int k = 0; k < 4; k++) {
                __m256i wl, wh;
                avx2_k_weights(ptype, sub, k, hf, &wl, &wh);
                for (int r = 0; r < nr; r++) {
                    int32_t l0, l1, h0, h1;
                    x_words(x, r * in_dim + b * QK + 4 * k, &l0, &l1, &h0, &h1);
                    const __m256i pa = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(h0));
                    const __m256i pb = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(h1));
                    if (ptype == PACKED_Q6K) { /* its halves scaled apart */
                        ta[r] = _mm256_add_epi16(ta[r], pa);
                        tb[r] = _mm256_add_epi16(tb[r], pb);
                    } else {
                        ta[r] = _mm256_add_epi16(ta[r], _mm256_add_epi16(pa, pb));
                    }
                    if (k & 1) {
                        h[r] = _mm256_add_epi32(h[r], _mm256_madd_epi16(ta[r], sc.sc[0]));
                        if (ptype == PACKED_Q6K) h[r] = _mm256_add_epi32(h[r], _mm256_madd_epi16(tb[r], sc.sc[1]));
                        ta[r] = tb[r] = zero;
                    }
                }
            }
            for (int r = 0; r < nr; r++) acc[r][hf] = avx2_k_scaled8(ptype, &sc, h[r], x, r * xb0 + b, acc[r][hf]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(out + r * 16, acc[r][0]);
        _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]);
    }
}

/* A tile row's 8-bit activations of one block (xr) against a block-half's weights w[2k] (values 4k..4k+3)
   and w[2k + 1] (16 + 4k..): the eight maddubs products, pairs summed in 16 bits. */
static inline __attribute__((always_inline)) void avx2_tile_products(const __m256i w[8], const int8_t *xr,
                                                                      __m256i p[8]) {
    for (int k = 0; k < 4; k++) {
        int32_t h0, h1;
        memcpy(&h0, xr + 4 * k, 4);
        memcpy(&h1, xr + 16 + 4 * k, 4);
        p[2 * k] = _mm256_maddubs_epi16(w[2 * k], _mm256_set1_epi32(h0));
        p[2 * k + 1] = _mm256_maddubs_epi16(w[2 * k + 1], _mm256_set1_epi32(h1));
    }
}
/* 8-bit activations, many rows (a prompt's, or many streams'): per sub-block and half, the eight weight
   vectors decoded once for every row of the tile, where avx2_k_rows8 decodes them again each four rows; and
   each row's scaling from the half's scales made once. A row's products summed in 16 bits over as many
   weight vectors as fit (Q4_K all eight: 8 x 2 x 127 x 15 < 2^15; Q5_K four; Q6_K two, its halves apart),
   then widened: the same integers as avx2_k_rows8, scaled by the same avx2_k_scaled8, so the same floats. out: the tile's accumulators, out[r * 16 + i], in L1 between sub-blocks. */
static inline __attribute__((always_inline)) void avx2_k_tile8(const int ptype, const uint8_t *grp, int64_t nblocks,
                                                                PackedX x, int64_t in_dim, const int64_t nr, float *out) {
    const int64_t supb = 8 * pack_block_bytes(ptype), xb0 = in_dim / QK;
    const int subb = packed_k_sub_bytes(ptype);
    __m256i dots[PACK_TILE];
    for (int64_t i = 0; i < nr * PACK_ROWS; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *head = grp + b / 8 * supb, *sub = packed_k_sub_at(ptype, head, (int)(b % 8));
        for (int c = 0; c < subb; c += 64) __builtin_prefetch(sub + 4096 + c, 0, 3);
        for (int hf = 0; hf < 2; hf++) {
            __m256i w[8];
            for (int k = 0; k < 4; k++) avx2_k_weights(ptype, sub, k, hf, &w[2 * k], &w[2 * k + 1]);
            const Avx2KScales sc = avx2_k_scales8(ptype, head, sub, hf);
            for (int64_t r = 0; r < nr; r++) {
                __m256i p[8];
                avx2_tile_products(w, x.hi + r * in_dim + b * QK, p);
                __m256i dot;
                if (ptype == PACKED_Q6K) { /* the first 16 values (even p) and the last 16 (odd) apart */
                    __m256i a0 = _mm256_add_epi16(p[0], p[2]), a1 = _mm256_add_epi16(p[4], p[6]);
                    __m256i b0 = _mm256_add_epi16(p[1], p[3]), b1 = _mm256_add_epi16(p[5], p[7]);
                    dot = _mm256_add_epi32(
                        _mm256_add_epi32(_mm256_madd_epi16(a0, sc.sc[0]), _mm256_madd_epi16(a1, sc.sc[0])),
                        _mm256_add_epi32(_mm256_madd_epi16(b0, sc.sc[1]), _mm256_madd_epi16(b1, sc.sc[1])));
                } else {
                    __m256i q0 = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
                    __m256i q1 = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
                    __asm__("" : "+x"(q0), "+x"(q1)); /* kept a tree: a chain of eight adds would lengthen each row's latency */
                    dot = ptype == PACKED_Q4K ? _mm256_madd_epi16(_mm256_add_epi16(q0, q1), sc.sc[0])
                                              : _mm256_add_epi32(_mm256_madd_epi16(q0, sc.sc[0]), _mm256_madd_epi16(q1, sc.sc[0]));
                }
                _mm256_store_si256(dots + r, dot);
            }
            for (int64_t r = 0; r < nr; r++) {
                float *o = out + r * PACK_ROWS + 8 * hf;
                _mm256_storeu_ps(o, avx2_k_scaled8(ptype, &sc, _mm256_load_si256(dots + r), x, r * xb0 + b, _mm256_loadu_ps(o)));
            }
        }
    }
}
#endif

/* out[r * 16 + i] = row i of a packed K group . activation row r (nr <= PACK_XROWS), as packed_group_dot_n:
   each sub-block's integer sums per row and half, then its scales for 16 rows at once. */
static inline __attribute__((always_inline)) void packed_k_group_dot_n(const int ptype, const uint8_t *grp,
                                                                        int64_t nblocks, PackedX x, int64_t in_dim,
                                                                        const int nr, const int x8, float *out) {
    const int64_t supb = 8 * pack_block_bytes(ptype), xb0 = in_dim / QK;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[PACK_XROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const int subb = packed_k_sub_bytes(ptype);
    for (int64_t s = 0; s < nblocks / 8; s++) {
        const uint8_t *head = grp + s * supb;
        const __m512 d = _mm512_loadu_ps(((const PackedKHead *)head)->d);
        const __m512 dmin = ptype != PACKED_Q6K ? _mm512_loadu_ps(((const PackedKHead *)head)->dmin) : _mm512_setzero_ps();
        for (int sb = 0; sb < 8; sb++) {
            const int64_t b = s * 8 + sb;
            const uint8_t *sub = packed_k_sub_at(ptype, head, sb);
            const PackedQ5KSub *s5 = (const PackedQ5KSub *)sub;
            const PackedQ6KSub *s6 = (const PackedQ6KSub *)sub;
            for (int c = 0; c < subb; c += 64) __builtin_prefetch(sub + 4096 + c, 0, 3);
            __m512i la[PACK_XROWS], ha[PACK_XROWS], lb[PACK_XROWS], hb[PACK_XROWS];
            for (int r = 0; r < nr; r++) la[r] = ha[r] = lb[r] = hb[r] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const __m512i raw = _mm512_loadu_si512((const void *)((const PackedNibbles *)sub)->q[k]);
                __m512i wl = _mm512_and_si512(raw, nib), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
                if (ptype == PACKED_Q6K) {
                    const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512((const void *)s6->qh[k >> 1]), 4 * (k & 1));
                    wl = _mm512_or_si512(wl, _mm512_slli_epi16(_mm512_and_si512(h, three), 4));
                    wh = _mm512_or_si512(wh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), three), 4));
                } else if (ptype == PACKED_Q5K) {
                    const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512((const void *)s5->qh), 2 * k);
                    wl = _mm512_or_si512(wl, _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
                    wh = _mm512_or_si512(wh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 1), one), 4));
                }
                for (int r = 0; r < nr; r++) {
                    const int64_t at = r * in_dim + b * QK + 4 * k;
                    int32_t l0, l1, h0, h1;
                    x_words(x, at, &l0, &l1, &h0, &h1);
                    if (!x8) {
                        la[r] = _mm512_dpbusd_epi32(la[r], _mm512_set1_epi32(l0), wl);
                        lb[r] = _mm512_dpbusd_epi32(lb[r], _mm512_set1_epi32(l1), wh);
                    }
                    ha[r] = _mm512_dpbusd_epi32(ha[r], wl, _mm512_set1_epi32(h0));
                    hb[r] = _mm512_dpbusd_epi32(hb[r], wh, _mm512_set1_epi32(h1));
                }
            }
            if (ptype != PACKED_Q6K) {
                const __m512 scale = _mm512_mul_ps(
                    d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)packed_k_scales(ptype, sub)))));
                const __m512 offset = _mm512_mul_ps(
                    dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)packed_k_mins(ptype, sub)))));
                for (int r = 0; r < nr; r++) {
                    const int64_t xb = r * xb0 + b;
                    const __m512i hs = _mm512_add_epi32(ha[r], hb[r]), ls = _mm512_add_epi32(la[r], lb[r]);
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls));
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.d[xb])), scale, acc[r]);
                    acc[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(x.sum[xb]), acc[r]);
                }
            } else {
                const __m512 s0 = _mm512_mul_ps(
                    d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s6->sc[0]))));
                const __m512 s1 = _mm512_mul_ps(
                    d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s6->sc[1]))));
                for (int r = 0; r < nr; r++) {
                    const int64_t xb = r * xb0 + b;
                    const __m512 dx = _mm512_set1_ps(x.d[xb]);
                    const __m512 da = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ha[r], 8), la[r]));
                    const __m512 db = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hb[r], 8), lb[r]));
                    /* one FMA a sub-block on the accumulator's chain: the rest folds first */
                    const __m512 t0 = _mm512_fmsub_ps(da, dx, _mm512_set1_ps(32.0f * x.sumh[xb]));
                    const __m512 t1 = _mm512_fmsub_ps(db, dx, _mm512_set1_ps(32.0f * (x.sum[xb] - x.sumh[xb])));
                    acc[r] = _mm512_fmadd_ps(t0, s0, _mm512_fmadd_ps(t1, s1, acc[r]));
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
#elif defined(PACKED_AVX2)
    (void)supb;
    (void)xb0;
    if (x8) {
        avx2_k_rows8(ptype, grp, nblocks, x, in_dim, nr, out);
    } else { /* a row at a time: four rows' low and high sums would not fit the registers */
        for (int r = 0; r < nr; r++) avx2_k_row16(ptype, grp, nblocks, packed_x_rows(x, r, in_dim), in_dim, r == 0, out + r * 16);
    }
#else
    /* the same integer sums and the same scaling, in plain loops (lo = 0 with x8) */
    (void)supb;
    (void)x8;
    float acc[PACK_XROWS][PACK_ROWS];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) acc[r][i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++)
        for (int i = 0; i < PACK_ROWS; i++) {
            float scale[2], offset;
            const uint8_t *sub = packed_k_sub(ptype, grp, b, i, scale, &offset);
            int u[QK];
            for (int j = 0; j < QK; j++) u[j] = packed_k_u(ptype, sub, i, j);
            for (int r = 0; r < nr; r++) {
                const int64_t at = r * in_dim + b * QK, xb = r * xb0 + b;
                int32_t lo[2] = {0, 0}, hi[2] = {0, 0};
                for (int j = 0; j < QK; j++) {
                    lo[j >> 4] += u[j] * x.lo[at + j];
                    hi[j >> 4] += u[j] * x.hi[at + j];
                }
                if (ptype != PACKED_Q6K) {
                    const float dot = (float)((hi[0] + hi[1]) * 256 + lo[0] + lo[1]);
                    acc[r][i] = fmaf(dot * x.d[xb], scale[0], acc[r][i]);
                    acc[r][i] = fmaf(-offset, x.sum[xb], acc[r][i]);
                } else {
                    acc[r][i] = fmaf((float)(hi[0] * 256 + lo[0]) * x.d[xb], scale[0], acc[r][i]);
                    acc[r][i] = fmaf((float)(hi[1] * 256 + lo[1]) * x.d[xb], scale[1], acc[r][i]);
                    acc[r][i] = fmaf(-scale[0], 32.0f * x.sumh[xb], acc[r][i]);
                    acc[r][i] = fmaf(-scale[1], 32.0f * (x.sum[xb] - x.sumh[xb]), acc[r][i]);
                }
            }
        }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < PACK_ROWS; i++) out[r * 16 + i] = acc[r][i];
#endif
}

#if defined(PACKED_AVX2)
/* A PACKED_Q4 / PACKED_Q5 / PACKED_MX4 tile of nr activation rows against 8-bit activations: each block-half's
   weights decoded once for every row (the four-row kernel decodes them again each four rows), every row's
   integer sums first, then their floats, the same ones as the four-row kernel's in the same order. */
static inline __attribute__((always_inline)) void avx2_q4_tile8(const int ptype, const uint8_t *grp, int64_t nblocks,
                                                                 PackedX x, int64_t in_dim, const int64_t nr, float *out) {
    const int pb = pack_block_bytes(ptype);
    const int64_t xb0 = in_dim / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dots[PACK_TILE];
    for (int64_t i = 0; i < nr * PACK_ROWS; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const PackedQ4Block *p4 = (const PackedQ4Block *)(grp + b * pb);
        for (int c = 0; c < pb; c += 64) __builtin_prefetch((const uint8_t *)p4 + 4096 + c, 0, 3);
        for (int hf = 0; hf < 2; hf++) {
            __m256i w[8];
            for (int k = 0; k < 4; k++) avx2_q4_part(ptype, p4, k, hf, &w[2 * k], &w[2 * k + 1]);
            for (int64_t r = 0; r < nr; r++) {
                __m256i p[8];
                avx2_tile_products(w, x.hi + r * in_dim + b * QK, p);
                __m256i q0 = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
                __m256i q1 = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
                __asm__("" : "+x"(q0), "+x"(q1)); /* a tree, as the K tile's */
                /* AVX2_SUMS16: Q4's eight products a lane fit 16 bits, Q5's and MXFP4's four */
                _mm256_store_si256(dots + r, AVX2_SUMS16(ptype) == 4
                                                 ? _mm256_madd_epi16(_mm256_add_epi16(q0, q1), ones)
                                                 : _mm256_add_epi32(_mm256_madd_epi16(q0, ones), _mm256_madd_epi16(q1, ones)));
            }
            __m256 d, m;
            avx2_q4_scales(ptype, p4, hf, &d, &m);
            for (int64_t r = 0; r < nr; r++) { /* the four-row kernel's floats */
                const int64_t xb = r * xb0 + b;
                float *o = out + r * PACK_ROWS + 8 * hf;
                const __m256 f = _mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_load_si256(dots + r), 8));
                __m256 acc = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_set1_ps(x.d[xb])), d, _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[xb]), acc));
            }
        }
    }
}
#endif

/* out[r * 16 + i] for any number of activation rows, PACK_XROWS at a time (the group's weights stay in L1
   between passes), specialized on the layout and the row count; on AVX2 with 8-bit activations, a K-quant's
   pack_tile_min rows or more as one tile. Callers pass up to PACK_TILE rows at once. */
static inline void packed_group_dot(int ptype, const uint8_t *grp, int64_t nblocks, PackedX x, int64_t in_dim,
                                    int64_t rows, float *out) {
#if defined(PACKED_AVX2)
    if (x.bits8 && packed_is_q4(ptype) && rows >= pack_tile_min(ptype)) {
        if (ptype == PACKED_Q4)
            avx2_q4_tile8(PACKED_Q4, grp, nblocks, x, in_dim, rows, out);
        else if (ptype == PACKED_Q5)
            avx2_q4_tile8(PACKED_Q5, grp, nblocks, x, in_dim, rows, out);
        else
            avx2_q4_tile8(PACKED_MX4, grp, nblocks, x, in_dim, rows, out);
        return;
    }
    if (x.bits8 && packed_is_k(ptype) && rows >= pack_tile_min(ptype)) {
        if (ptype == PACKED_Q4K)
            avx2_k_tile8(PACKED_Q4K, grp, nblocks, x, in_dim, rows, out);
        else if (ptype == PACKED_Q5K)
            avx2_k_tile8(PACKED_Q5K, grp, nblocks, x, in_dim, rows, out);
        else
            avx2_k_tile8(PACKED_Q6K, grp, nblocks, x, in_dim, rows, out);
        return;
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += PACK_XROWS) {
        const PackedX xr = packed_x_rows(x, r0, in_dim);
        float *o = out + r0 * PACK_ROWS;
        const int64_t nr = rows - r0 < PACK_XROWS ? rows - r0 : PACK_XROWS;
#define PACKED_ROWS_CASES_X(F, P, X)                                            \
    switch (nr) {                                                               \
        case 1: F(P, grp, nblocks, xr, in_dim, 1, X, o); break;                 \
        case 2: F(P, grp, nblocks, xr, in_dim, 2, X, o); break;                 \
        case 3: F(P, grp, nblocks, xr, in_dim, 3, X, o); break;                 \
        default: F(P, grp, nblocks, xr, in_dim, PACK_XROWS, X, o); break;       \
    }
#define PACKED_ROWS_CASES(F, P)                                                 \
    if (x.bits8) {                                                              \
        PACKED_ROWS_CASES_X(F, P, 1)                                            \
    } else {                                                                    \
        PACKED_ROWS_CASES_X(F, P, 0)                                            \
    }
        switch (ptype) {
            case PACKED_Q8: PACKED_ROWS_CASES(packed_group_dot_n, PACKED_Q8) break;
            case PACKED_MX4: PACKED_ROWS_CASES(packed_group_dot_n, PACKED_MX4) break;
            case PACKED_Q5: PACKED_ROWS_CASES(packed_group_dot_n, PACKED_Q5) break;
            case PACKED_Q4K: PACKED_ROWS_CASES(packed_k_group_dot_n, PACKED_Q4K) break;
            case PACKED_Q5K: PACKED_ROWS_CASES(packed_k_group_dot_n, PACKED_Q5K) break;
            case PACKED_Q6K: PACKED_ROWS_CASES(packed_k_group_dot_n, PACKED_Q6K) break;
            default: PACKED_ROWS_CASES(packed_group_dot_n, PACKED_Q4) break;
        }
#undef PACKED_ROWS_CASES
#undef PACKED_ROWS_CASES_X
    }
}

#endif
