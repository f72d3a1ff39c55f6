/* The fused decode step's LoRA stage (decode_step.c): after a projection's matmul, each token's adapter adds
 * its low-rank update to the token's outputs, shrink (x @ A^T, a few values a token) then expand (@ B^T), as
 * the layer path's StepLora.apply (worker/model/lora.py) does. The step's rows are cut into runs of one
 * adapter (at most ROWS tokens), so a run reads each row of A and of B once for all its tokens; the shrink
 * runs inside the projection's own loop, the expand after it. */
#ifndef PAGEDSERVE_LORA_ROWS_H
#define PAGEDSERVE_LORA_ROWS_H
#include <stdint.h>
#include <stdlib.h>

#include "pagedserve.h"
#include "quant_blocks.h"

#define LORA_OUT_CHUNK 64 /* output rows a thread takes at a time in the expand */

typedef struct {
    int32_t *start, *len, *adapter; /* each run's first row, its rows, its adapter */
    int64_t n;
    float* t;         /* [rows, t_stride]: each token's shrunk values */
    int64_t t_stride; /* the most rows of A any projection of the step's adapters has */
} LoraRuns;

static inline const PsLoraProj* lora_proj(const PsLora* l, int64_t num_layers, int64_t adapter, int layer,
                                          int which) {
    return l->proj + (adapter * num_layers + layer) * 4 + which;
}

/* The runs of the step's rows (and their scratch); 0 with runs->n == 0 where no row has an adapter, -1 for
   an adapter index or a projection the model's shapes cannot hold. out_dims: the four projections' outputs.
   lora_runs_free gives back what it took, whatever it returned. */
static int lora_runs(const PsLora* l, int64_t num_layers, const int64_t out_dims[4], int64_t rows, LoraRuns* runs) {
    runs->n = 0;
    runs->start = 0;
    runs->t = 0;
    runs->t_stride = 0;
    if (l == 0 || l->n_adapters <= 0) return 0;
    for (int64_t i = 0; i < (int64_t)l->n_adapters * num_layers * 4; i++) {
        const PsLoraProj* p = l->proj + i;
        if (p->a == 0) continue;
        if (p->a_rows < 1 || p->n_parts < 1 || p->n_parts > PS_MAX_SEGMENTS || p->out_lo < 0
            || p->out_hi > out_dims[i % 4] || p->out_lo >= p->out_hi)
            return -1;
        for (int q = 0; q < p->n_parts; q++) {
            const int32_t* pt = p->part[q];
            if (p->b[q] == 0 || pt[0] < 0 || pt[1] > p->a_rows || pt[0] >= pt[1] || pt[2] < p->out_lo || pt[3] > p->out_hi
                || pt[2] >= pt[3])
                return -1;
        }
        if (p->a_rows > runs->t_stride) runs->t_stride = p->a_rows;
    }
    runs->start = malloc(sizeof(int32_t) * 3 * rows);
    if (runs->start == 0) return -1;
    runs->len = runs->start + rows;
    runs->adapter = runs->len + rows;
    for (int64_t r = 0; r < rows; r++) {
        const int32_t g = l->row_adapter[r];
        if (g < -1 || g >= l->n_adapters) return -1;
        if (g < 0) continue;
        const int64_t u = runs->n - 1;
        if (runs->n && runs->adapter[u] == g && runs->start[u] + runs->len[u] == r && runs->len[u] < ROWS) {
            runs->len[u]++;
            continue;
        }
        runs->start[runs->n] = (int32_t)r;
        runs->len[runs->n] = 1;
        runs->adapter[runs->n++] = g;
    }
    if (runs->n && runs->t_stride) {
        runs->t = malloc(sizeof(float) * rows * runs->t_stride);
        if (runs->t == 0) return -1;
    }
    return 0;
}

static void lora_runs_free(LoraRuns* runs) {
    free(runs->start);
    free(runs->t);
}

/* Where the stage is: the step's adapters and runs, and the projection (0-3: qkv, o_proj, gate_up, down)
   of a layer. */
typedef struct {
    const PsLora* l;
    const LoraRuns* runs;
    int64_t num_layers;
    int layer, which;
} LoraAt;

/* The shrink's work items: a run's tokens times one row of A (the matmul's loop takes them beside its own
   chunks, so the shrink costs no barrier of its own). */
static inline int64_t lora_shrink_items(const LoraAt* at) {
    return at ? at->runs->n * at->runs->t_stride : 0;
}

static void lora_shrink_item(const LoraAt* at, const float* x, int64_t in_dim, int64_t it) {
    const LoraRuns* runs = at->runs;
    const int64_t ts = runs->t_stride, u = it / ts, k = it % ts;
    const PsLoraProj* p = lora_proj(at->l, at->num_layers, runs->adapter[u], at->layer, at->which);
    if (p->a == 0 || k >= p->a_rows) return;
    float acc[ROWS];
    const int64_t r0 = runs->start[u];
    rows_dot(F32, (const uint8_t*)(p->a + k * in_dim), in_dim / QK, x + r0 * in_dim, in_dim, runs->len[u], acc);
    for (int r = 0; r < runs->len[u]; r++) runs->t[(r0 + r) * ts + k] = acc[r];
}

/* y[r, :] += each run's adapter's expand of its tokens' shrunk values, once the shrink is done; called by
   every thread of the region (one barrier). */
static void lora_expand(const LoraAt* at, float* y, int64_t out_dim) {
    const LoraRuns* runs = at->runs;
    const int64_t ts = runs->t_stride;
    const int64_t chunks = (out_dim + LORA_OUT_CHUNK - 1) / LORA_OUT_CHUNK;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o0 = c * LORA_OUT_CHUNK, o1 = o0 + LORA_OUT_CHUNK < out_dim ? o0 + LORA_OUT_CHUNK : out_dim;
        for (int64_t u = 0; u < runs->n; u++) {
            const PsLoraProj* p = lora_proj(at->l, at->num_layers, runs->adapter[u], at->layer, at->which);
            if (p->a == 0) continue;
            const int64_t r0 = runs->start[u];
            for (int q = 0; q < p->n_parts; q++) {
                const int32_t a_lo = p->part[q][0], n = p->part[q][1] - a_lo;
                const int64_t lo = o0 > p->part[q][2] ? o0 : p->part[q][2];
                const int64_t hi = o1 < p->part[q][3] ? o1 : p->part[q][3];
                for (int64_t o = lo; o < hi; o++) {
                    const float* brow = p->b[q] + (o - p->part[q][2]) * n;
                    for (int r = 0; r < runs->len[u]; r++) {
                        const float* tr = runs->t + (r0 + r) * ts + a_lo;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int32_t i = 0; i < n; i++) s += brow[i] * tr[i];
                        y[(r0 + r) * out_dim + o] += s;
                    }
                }
            }
        }
    }
}
#endif
