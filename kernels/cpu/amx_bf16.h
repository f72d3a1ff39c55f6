/* BF16 weight rows multiplied on AMX tiles (Sapphire Rapids and later), read as the checkpoint holds them.

   The row kernel (quant_blocks.h) widens each bf16 weight to fp32 and loads every activation row per block
   for one FMA each: past four rows it is bound by those loads. Here a tile A is 16 weight rows x 32 values
   straight from the matrix (the row stride is the tile's), and a tile B holds 32 values of 16 activation rows
   in the pairs AMX multiplies (VNNI: pair p of row m at bytes 4 m + 64 p), so `tdpbf16ps` adds 16 x 16 x 32
   products into C[o][m] in fp32. A weight tile meets up to four activation tiles (64 rows) before the next
   is read.

   Precision: each activation is rounded to bf16 (as oneDNN's bf16 GEMM and a bf16 model's own layers do);
   the weights are exact, each product exact in fp32, and the tiles' sums follow a fixed order, the same for
   every row: an answer never depends on its company. Tile loads and products do not overlap on these cores
   and a product takes ~2x its nominal 16 cycles, so a second (low) bf16 half of each activation doubled the
   work: 64 rows ran at a third of the read limit (docs/BENCHMARKS.md).

   The OS hands a process AMX state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM): amx_permitted asks once,
   for these rows and prefill attention's tiles (prefill_tiles.h). Each thread loads the tile configuration
   before its tiles (amx_begin: eight of 16 rows x 64 bytes) and releases them after. */
#ifndef PAGEDSERVE_AMX_BF16_H
#define PAGEDSERVE_AMX_BF16_H
#include <stdint.h>
#include <string.h>

#include "convert.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define AMX_BF16 1
#include <immintrin.h>
#endif

#define AMX_ROWS 16   /* weight rows of a tile, and activation rows of one */
#define AMX_K 32      /* values of a row a tile spans */
#define AMX_MBLOCKS 4 /* activation tiles a weight tile meets at once */

/* 1 where the OS grants this process AMX tile state (quant_matmul.c asks once), else 0. */
int amx_permitted(void);
/* 1 where BF16 rows go on tiles: granted and not turned off (pagedserve_bf16_rounded), else 0. */
int amx_bf16_ready(void);

/* Bytes of the activations as tiles: ceil(rows / 16) blocks x in_dim / 32 tiles x 1 KB. */
static inline int64_t amx_x_bytes(int64_t rows, int64_t in_dim) {
    return (rows + AMX_ROWS - 1) / AMX_ROWS * (in_dim / AMX_K) * 1024;
}

/* Whether a matrix of this shape is multiplied on tiles: whole 32-value spans (the rows past the last whole 16
   take the row kernel). */
static inline int amx_shape(int64_t in_dim) { return in_dim % AMX_K == 0 && in_dim > 0; }

/* Tile t = (block of 16 rows, span of 32 values) of x [rows, in_dim] fp32 into xp, each value rounded to bf16,
   rows past `rows` zero. Called over t = 0 .. ceil(rows / 16) * in_dim / 32 - 1, in any order. */
static inline void amx_x_tile(const float *x, int64_t rows, int64_t in_dim, uint16_t *xp, int64_t t) {
    const int64_t spans = in_dim / AMX_K, mb = t / spans, kc = t % spans;
    uint16_t *tile = xp + t * 512;
    for (int m = 0; m < AMX_ROWS; m++) {
        const int64_t r = mb * AMX_ROWS + m;
        for (int k = 0; k < AMX_K; k++)
            tile[(k >> 1) * 32 + 2 * m + (k & 1)] = r < rows ? float_to_bf16_nobranch(x[r * in_dim + kc * AMX_K + k]) : 0;
    }
}

#ifdef AMX_BF16
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* This thread's tiles: eight of 16 rows x 64 bytes. */
static inline void amx_begin(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}
static inline void amx_end(void) { _tile_release(); }

/* How far ahead (32-value spans) a weight tile's rows are asked for on the first pass over them. */
#define AMX_PREFETCH 8

/* C_j += A . B_j over every span, for nm activation blocks; C in tiles 0-3, A 4, B 5-7 (the fourth block's
   B reuses 5 once its product is issued). */
static inline __attribute__((always_inline)) void amx_spans(const uint16_t *w, int64_t in_dim, const uint16_t *xb,
                                                           const int nm, int prefetch) {
    const int64_t spans = in_dim / AMX_K, stride = in_dim * 2, blk = spans * 512;
    _tile_zero(0);
    if (nm > 1) _tile_zero(1);
    if (nm > 2) _tile_zero(2);
    if (nm > 3) _tile_zero(3);
    for (int64_t kc = 0; kc < spans; kc++) {
        if (prefetch && kc + AMX_PREFETCH < spans)
            for (int r = 0; r < AMX_ROWS; r++)
                _mm_prefetch((const char *)(w + r * in_dim + (kc + AMX_PREFETCH) * AMX_K), _MM_HINT_T0);
        _tile_loadd(4, w + kc * AMX_K, stride);
        const uint16_t *b = xb + kc * 512;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nm > 1) {
            _tile_loadd(6, b + blk, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nm > 2) {
            _tile_loadd(7, b + 2 * blk, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nm > 3) {
            _tile_loadd(5, b + 3 * blk, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
}

/* y[r, o0 + i] for i < 16 and every row r < rows: weight rows w (row o0 of the matrix) .. w + 15 * in_dim
   against xp (amx_x_tile's). y is [rows, out_dim]. Between amx_begin and amx_end. */
static inline void amx_group(const uint16_t *w, int64_t in_dim, const uint16_t *xp, int64_t rows, float *y,
                             int64_t out_dim, int64_t o0) {
    const int64_t mblocks = (rows + AMX_ROWS - 1) / AMX_ROWS, blk = in_dim / AMX_K * 512;
    float c[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    for (int64_t mb = 0; mb < mblocks; mb += AMX_MBLOCKS) {
        const int nm = mblocks - mb < AMX_MBLOCKS ? (int)(mblocks - mb) : AMX_MBLOCKS;
        const uint16_t *xb = xp + mb * blk;
        switch (nm) { /* the tile numbers are immediates: one copy per count */
            case 1: amx_spans(w, in_dim, xb, 1, mb == 0); break;
            case 2: amx_spans(w, in_dim, xb, 2, mb == 0); break;
            case 3: amx_spans(w, in_dim, xb, 3, mb == 0); break;
            default: amx_spans(w, in_dim, xb, 4, mb == 0);
        }
        for (int j = 0; j < nm; j++) {
            if (j == 0) _tile_stored(0, c, 64);
            else if (j == 1) _tile_stored(1, c, 64);
            else if (j == 2) _tile_stored(2, c, 64);
            else _tile_stored(3, c, 64);
            for (int m = 0; m < AMX_ROWS && (mb + j) * AMX_ROWS + m < rows; m++) {
                float *yr = y + ((mb + j) * AMX_ROWS + m) * out_dim + o0;
                for (int o = 0; o < AMX_ROWS; o++) yr[o] = c[o * AMX_ROWS + m];
            }
        }
    }
}
#endif
#endif
