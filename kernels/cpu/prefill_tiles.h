/* Prefill attention on AMX tiles (Sapphire Rapids and later: AMX-BF16), for a model served in bf16 over a bf16
 * pool: the bf16-dot-product item of paged_prefill.c (same rounding: scaled queries and softmax weights in
 * bf16, fp32 sums and softmax state), with both products as tile multiplies. One TDPBF16PS multiplies 16
 * rows by 32 bf16 values by 16 columns, sixteen times the work of a vector dot product, so the softmax in
 * vector registers is what is left to pay for.
 *
 * Per 32-key tile: the keys as B tiles (pairs of adjacent dimensions down, keys across: the 16 x 16
 * transposes of the bf16 item), the values as B tiles (pairs of adjacent keys down, dimensions across). Per
 * block of 16 query rows: scores = Q (16 x 32 dimensions a tile) x K for both 16-key halves, stored;
 * each row's online softmax over the 32 keys in two vectors; then P (16 x 32 keys) x V, 16 dimensions a
 * tile, added into the row's fp32 accumulator after its rescale. Rows past the item's (a partial block)
 * are zero queries whose results are dropped.
 *
 * Where the OS refuses the tile state (amx_permitted), or pagedserve_prefill_tiles(0) says so, the vector item
 * runs. Included by paged_prefill.c after its helpers (kv_at, transpose16, init_rows, row_span, rescale,
 * write_rows, ZERO_ROW). */
#if defined(PREFILL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PREFILL_TILES 1
#include "amx_bf16.h"

#define TK 32 /* keys per tile: one A tile's row of softmax weights */

static int tiles_wanted = 1;

static int tiles_ready(void) { return tiles_wanted && amx_permitted(); }

/* The tiles (amx_begin's eight): 0, 1 scores; 2 queries; 3, 4 keys; 5 weights; 6 a product; 7 values. */

/* A row's 32 scores over keys [from, n) (from < n): the running softmax updated, its weights in bf16 at pw. */
static inline float tile_softmax32(const float* s, int from, int n, float* m, float* l, uint16_t* pw) {
    const uint32_t valid = (n >= 32 ? 0xffffffffu : (1u << n) - 1u) & ~((1u << from) - 1u);
    const __mmask16 v0 = (__mmask16)valid, v1 = (__mmask16)(valid >> 16);
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const float t0 = _mm512_mask_reduce_max_ps(v0, s0), t1 = _mm512_mask_reduce_max_ps(v1, s1);
    const float top_tile = t0 > t1 ? t0 : t1, top = top_tile > *m ? top_tile : *m;
    const __m512 tv = _mm512_set1_ps(top);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, exp512_nonpositive(_mm512_sub_ps(s0, tv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, exp512_nonpositive(_mm512_sub_ps(s1, tv)));
    _mm512_storeu_si512((void*)pw, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return rescale(top, _mm512_reduce_add_ps(_mm512_add_ps(p0, p1)), m, l);
}

/* One 32-key tile's keys and values laid out as B tiles: kt[c][half] for dimensions 32c.., vt[kp][d]. */
static inline void tiles_layout(const uint16_t* const krows[TK], const uint16_t* const vrows[TK], int head_dim,
                                uint32_t (*kt)[2][16][16], uint32_t (*vt)[MAX_HEAD_DIM]) {
    for (int half = 0; half < 2; half++)
        for (int c = 0; c < head_dim / 32; c++)
            transpose16((const float* const*)(krows + 16 * half), 16 * c, (float(*)[KT])kt[c][half]);
    for (int kp = 0; kp < TK / 2; kp++)
        for (int d = 0; d < head_dim; d += 16) {
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrows[2 * kp] + d)));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrows[2 * kp + 1] + d)));
            _mm512_storeu_si512((void*)(vt[kp] + d), _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
}

/* prefill_item_bf16 on tiles (head_dim a multiple of 32; the caller asked tiles_ready()). */
static void prefill_item_tiles(const float* q, int64_t q_row_stride, const uint16_t* k_cache,
                               const uint16_t* v_cache, float* out, int64_t start, int q_len, int seq_len,
                               const int32_t* table, int p0, int p1, int kh, int n_heads, int group, int head_dim,
                               int block_size, int64_t block_stride, int64_t token_stride, float scale, int window,
                               float softcap, const float* sinks) {
    const int rows = p1 - p0, total = rows * group, hp = head_dim / 2, blocks = (total + 15) / 16;
    float acc[MAX_STATE];                                 /* [total][head_dim] */
    uint32_t qp[MAX_STATE / 2 + 16 * MAX_HEAD_DIM / 2]; /* [blocks * 16][hp]: scaled queries, bf16 pairs */
    float m[QT * 16], l[QT * 16];
    int limit[QT * 16], lowest[QT * 16];
    uint32_t kt[MAX_HEAD_DIM / 32][2][16][16];
    uint32_t vt[TK / 2][MAX_HEAD_DIM];
    float s[16][TK], part[16][16], corr[16];
    uint16_t pw[16][TK];
    int from_of[16], n_of[16];
    const int offset = seq_len - q_len;
    const __m512 sc = _mm512_set1_ps(scale);
    memset(qp + (int64_t)total * hp, 0, sizeof(uint32_t) * (blocks * 16 - total) * hp);
    for (int g = 0; g < group; g++) {
        const int h = kh * group + g;
        for (int r = 0; r < rows; r++) {
            const float* src = q + (start + p0 + r) * q_row_stride + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d += 32) {
                const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(src + d), sc);
                const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), sc);
                _mm512_storeu_si512((void*)(qp + (g * rows + r) * hp + d / 2), (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
        }
    }
    init_rows(rows, group, p0, offset, window, head_dim, acc, m, l, limit, lowest);
    amx_begin();
    const int last_key = offset + p1 - 1, first_key = lowest[0];
    for (int j0 = first_key - first_key % TK; j0 <= last_key; j0 += TK) {
        const int nk = last_key + 1 - j0 < TK ? last_key + 1 - j0 : TK;
        const uint16_t* krows[TK];
        const uint16_t* vrows[TK];
        for (int jj = 0; jj < TK; jj++) {
            const int seen = jj < nk && j0 + jj >= first_key;
            const int64_t at = seen ? kv_at(table, j0 + jj, block_size, block_stride, token_stride, kh, head_dim) : 0;
            krows[jj] = seen ? k_cache + at : ZERO_ROW;
            vrows[jj] = seen ? v_cache + at : ZERO_ROW;
        }
        tiles_layout(krows, vrows, head_dim, kt, vt);
        for (int b = 0; b < blocks; b++) {
            int any = 0;
            for (int i = 0; i < 16; i++) {
                from_of[i] = n_of[i] = 0;
                if (b * 16 + i < total) row_span(limit[b * 16 + i], lowest[b * 16 + i], j0, nk, &from_of[i], &n_of[i]);
                any |= n_of[i] > from_of[i];
            }
            if (!any) continue;
            _tile_zero(0);
            _tile_zero(1);
            for (int c = 0; c < head_dim / 32; c++) {
                _tile_loadd(2, qp + (int64_t)b * 16 * hp + 16 * c, hp * 4);
                _tile_loadd(3, kt[c][0], 64);
                _tile_loadd(4, kt[c][1], 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, &s[0][0], TK * 4);
            _tile_stored(1, &s[0][16], TK * 4);
            if (softcap > 0.0f) soft_cap(&s[0][0], 16 * TK, softcap);
            for (int i = 0; i < 16; i++) {
                const int row = b * 16 + i;
                if (n_of[i] <= from_of[i]) {
                    _mm512_storeu_si512((void*)pw[i], _mm512_setzero_si512());
                    continue;
                }
                corr[i] = tile_softmax32(s[i], from_of[i], n_of[i], &m[row], &l[row], pw[i]);
            }
            _tile_loadd(5, pw, TK * 2);
            for (int e = 0; e < head_dim; e += 16) {
                _tile_zero(6);
                _tile_loadd(7, &vt[0][e], MAX_HEAD_DIM * 4);
                _tile_dpbf16ps(6, 5, 7);
                _tile_stored(6, part, 64);
                for (int i = 0; i < 16; i++) {
                    if (n_of[i] <= from_of[i]) continue;
                    float* a = acc + (int64_t)(b * 16 + i) * head_dim + e;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(corr[i]),
                                                        _mm512_loadu_ps(part[i])));
                }
            }
        }
    }
    amx_end();
    write_rows(out, acc, l, m, sinks, start + p0, rows, group, kh, n_heads, head_dim);
}
#endif
