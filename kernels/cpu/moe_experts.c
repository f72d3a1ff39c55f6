/* A mixture of experts' MLP (worker/model/moe.py) on the experts' blocks, for the layer path (one call a layer:
 * pagedserve_moe_experts) and the fused decode step (decode_step.c, inside its parallel region): the same stages.
 *
 * Routing (pagedserve_moe_route, the fused step's; the layer path routes in torch): each row's router logits,
 * softmax or sigmoid scores, the top_k by score (the correction added where there is one), their scores as the
 * weights, renormalized and scaled, as MoE.route computes them.
 *
 * The experts (pagedserve_moe_stages): the (row, expert) pairs sorted by expert, stably, as torch.sort orders them;
 * each pair's row gathered; every chosen expert's gate_up for its rows, as one `omp for` over (expert, 32 output
 * rows) items; the activation (SiLU-mul, gpt-oss's clamped SwiGLU, or Nemotron-H's relu² of up alone); down the same way into each pair's own
 * row; and each token's rows summed, weight times (down + bias), in expert order from zero, as grouped_experts
 * adds them. Eight stages whatever the experts chosen: one `omp for` a stage an expert would cost 16 streams of
 * a 32-expert model ~100 barriers a layer. Weights are each expert's blocks (packed: 16-bit, or with bits8 8-bit
 * activations; else the fp32 dot products, type 0 for plain fp32 rows), gate rows then up rows. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "pagedserve.h"
#include "packed_blocks.h"
#include "quant_blocks.h"
#include "rows.h"

static void expert_act(const float *gu, float *a, int64_t inter, float limit, float alpha, int relu2) {
    const float *g = gu, *u = gu + inter;
    if (relu2) { /* gu is up alone */
        for (int64_t i = 0; i < inter; i++) {
            const float r = gu[i] > 0.0f ? gu[i] : 0.0f;
            a[i] = r * r;
        }
        return;
    }
    if (limit == 0.0f) {
        silu_mul_span(g, u, a, 0, inter);
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) { /* (up + 1) gate sigmoid(alpha gate), gate <= limit, |up| <= limit */
        const float gi = fminf(g[i], limit), ui = fminf(fmaxf(u[i], -limit), limit);
        a[i] = (ui + 1.0f) * (gi / (1.0f + vec_exp(-alpha * gi)));
    }
}

static int expert_type_ok(int32_t type, int64_t in_dim, int64_t out_dim) {
    if (packed_type(type)) return out_dim % PACK_ROWS == 0 && in_dim % (packed_is_k(type) ? QK_K : QK) == 0;
    return block_bytes(type) > 0 && in_dim % block_values(type) == 0;
}

int pagedserve_moe_checks(const PsExperts *ex, int64_t hidden) {
    const int64_t inter = ex->inter;
    if (ex->experts < 1 || ex->top_k < 1 || ex->top_k > ex->experts || ex->top_k > 64 || ex->groups > 64 || inter < 1 || hidden % QK || inter % QK)
        return -1;
    if (!ex->gate_up || !ex->down || (ex->sigmoid == 0 && ex->correction)) return -1;
    if (ex->groups < 1 || ex->experts % ex->groups || ex->topk_groups < 1 || ex->topk_groups > ex->groups
        || (ex->groups > 1 && ex->experts / ex->groups < 2))
        return -1;
    const int64_t span = (ex->relu2 ? 1 : 2) * inter;
    return expert_type_ok(ex->gate_up_type, hidden, span) && expert_type_ok(ex->down_type, inter, hidden) ? 0 : -1;
}

/* The work's parts for `pairs` (row, expert) pairs: int64 start [experts + 1], row_of, pos_of [pairs], used
   [experts + 1] (the chosen experts, then their count); floats xe [pairs, max(hidden, inter)] (rows in, then the
   activations), ge [pairs, 2 inter], ye [pairs, hidden]; the packed rows. Each part 64-byte aligned. */
typedef struct {
    int64_t *start, *row_of, *pos_of, *used;
    float *xe, *ge, *ye;
    void *packed;
    int64_t experts; /* used[experts]: how many were chosen */
} MoeWork;

static int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

static MoeWork moe_work(const PsExperts *ex, int64_t hidden, int64_t tokens, void *mem, int64_t *bytes) {
    const int64_t pairs = tokens * ex->top_k, E = ex->experts, inter = ex->inter;
    const int64_t widest = hidden > inter ? hidden : inter;
    const int64_t sizes[8] = {8 * (E + 1), 8 * pairs, 8 * pairs, 8 * (E + 1), 4 * pairs * widest,
                              4 * pairs * (ex->relu2 ? 1 : 2) * inter, 4 * pairs * hidden,
                              packed_x_bytes(pairs, packed_x_pitch(widest))};
    char *p = mem;
    void *at[8];
    int64_t total = 0;
    for (int i = 0; i < 8; i++) {
        at[i] = p ? p + total : 0;
        total += align64(sizes[i]);
    }
    if (bytes) *bytes = total;
    MoeWork w = {at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7], E};
    return w;
}

int64_t pagedserve_moe_work_bytes(const PsExperts *ex, int64_t hidden, int64_t tokens) {
    int64_t bytes;
    moe_work(ex, hidden, tokens, 0, &bytes);
    return bytes;
}

/* a row of the router against x, in vector lanes (the layer path's F.linear sums in another order too) */
static float router_dot(const float *w, const float *x, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += w[i] * x[i];
    return acc;
}

/* one row's choice from its logits (scores [experts], turned into the scores in place) */
static void choose_row(const PsExperts *ex, int64_t *ids, float *weights, float *scores) {
    const int64_t E = ex->experts, K = ex->top_k;
    float top = -INFINITY;
    for (int64_t e = 0; e < E; e++) top = scores[e] > top ? scores[e] : top;
    if (ex->sigmoid) {
        for (int64_t e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    } else {
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += scores[e] = expf(scores[e] - top);
        for (int64_t e = 0; e < E; e++) scores[e] /= sum;
    }
    /* grouped: a group's worth its two best scores (to choose by); only the best topk_groups groups' experts */
    const int64_t G = ex->groups, per = E / G;
    uint64_t open = ~(uint64_t)0; /* groups still open, a bit each (G <= 64) */
    if (G > 1) {
        float worth[64];
        for (int64_t g = 0; g < G; g++) {
            float a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                const float by = scores[e] + (ex->correction ? ex->correction[e] : 0.0f);
                if (by > a) b = a, a = by;
                else if (by > b) b = by;
            }
            worth[g] = a + b;
        }
        open = 0;
        for (int64_t n = 0; n < ex->topk_groups; n++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!(open >> g & 1) && (best < 0 || worth[g] > worth[best])) best = g;
            open |= (uint64_t)1 << best;
        }
    }
    float total = 0.0f;
    for (int64_t k = 0; k < K; k++) { /* the best not yet taken, the lowest index first among equals */
        int64_t best = -1;
        float best_by = -INFINITY;
        for (int64_t e = 0; e < E; e++) {
            int taken = !(open >> (e / per) & 1);
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
            const float by = scores[e] + (ex->correction ? ex->correction[e] : 0.0f);
            if (!taken && (best < 0 || by > best_by)) best = e, best_by = by;
        }
        ids[k] = best;
        weights[k] = scores[best];
        total += weights[k];
    }
    for (int64_t k = 0; k < K; k++) {
        if (ex->normalize) weights[k] /= total + ex->norm_eps;
        weights[k] *= ex->scale;
    }
}

void pagedserve_moe_route(const PsExperts *ex, int64_t hidden, const float *x, int64_t tokens, int64_t *ids,
                          float *weights, float *scores) {
    const int64_t E = ex->experts, K = ex->top_k;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < tokens * E; it++) /* every (row, expert) logit: a row's are few for one thread */
        scores[it] = router_dot(ex->router + it % E * hidden, x + it / E * hidden, hidden)
                     + (ex->router_bias ? ex->router_bias[it % E] : 0.0f);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) choose_row(ex, ids + t * K, weights + t * K, scores + t * E);
}

/* Every chosen expert's matrix (mats[e]: its blocks' address) for the rows sorted to it: in's rows (px where
   packed) -> out's, one `omp for` over (expert, 32 output rows: whole groups of 16) items. */
static void expert_rows(const MoeWork *w, int32_t type, const int64_t *mats, const float *in, PackedX px,
                        int64_t in_dim, int64_t out_dim, float *out) {
    const int64_t chunks = (out_dim + 31) / 32, n_used = w->used[w->experts];
#pragma omp for schedule(guided)
    for (int64_t it = 0; it < n_used * chunks; it++) {
        const int64_t e = w->used[it / chunks], c0 = it % chunks * 32, c1 = c0 + 32 < out_dim ? c0 + 32 : out_dim;
        const int64_t s = w->start[e], n = w->start[e + 1] - s;
        block_rows(type, (const uint8_t *)(uintptr_t)mats[e], in + s * in_dim,
                   packed_x_rows(px, s, packed_x_pitch(in_dim)), n, in_dim, out_dim, c0, c1, out + s * out_dim);
    }
}

void pagedserve_moe_stages(const PsExperts *ex, int64_t hidden, const float *x, int64_t tokens, const int64_t *ids,
                           const float *weights, int32_t bits8, float *out, void *work) {
    const int64_t K = ex->top_k, E = ex->experts, inter = ex->inter, span = (ex->relu2 ? 1 : 2) * inter;
    const int64_t pairs = tokens * K;
    const int32_t gt = ex->gate_up_type, dt = ex->down_type;
    const MoeWork w = moe_work(ex, hidden, tokens, work, 0);
#pragma omp single
    { /* a counting sort, stable: torch.sort's order; used[] the cursors first, then the chosen experts */
        memset(w.start, 0, sizeof(int64_t) * (size_t)(E + 1));
        for (int64_t i = 0; i < pairs; i++) w.start[ids[i] + 1]++;
        for (int64_t e = 0; e < E; e++) w.start[e + 1] += w.start[e];
        for (int64_t e = 0; e < E; e++) w.used[e] = w.start[e];
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t at = w.used[ids[i]]++;
            w.row_of[at] = i;
            w.pos_of[i] = at;
        }
        int64_t n_used = 0;
        for (int64_t e = 0; e < E; e++)
            if (w.start[e + 1] > w.start[e]) w.used[n_used++] = e;
        w.used[E] = n_used;
    }
    PackedX ph = packed_x_at(w.packed, pairs, packed_x_pitch(hidden));
    ph.bits8 = bits8;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        memcpy(w.xe + p * hidden, x + w.row_of[p] / K * hidden, sizeof(float) * (size_t)hidden);
    if (packed_type(gt)) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs * (hidden / QK); i++) packed_x_block(w.xe, ph, i, hidden / QK);
    }
    expert_rows(&w, gt, ex->gate_up, w.xe, ph, hidden, span, w.ge);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        float *gu = w.ge + p * span;
        if (ex->gate_up_bias) {
            const float *b = ex->gate_up_bias + ids[w.row_of[p]] * span;
            for (int64_t i = 0; i < span; i++) gu[i] += b[i];
        }
        expert_act(gu, w.xe + p * inter, inter, ex->limit, ex->alpha, ex->relu2); /* the activations replace the rows */
    }
    PackedX pa = packed_x_at(w.packed, pairs, packed_x_pitch(inter));
    pa.bits8 = bits8;
    if (packed_type(dt)) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs * (inter / QK); i++) packed_x_block(w.xe, pa, i, inter / QK);
    }
    expert_rows(&w, dt, ex->down, w.xe, pa, inter, hidden, w.ye);
    const int64_t oc = (hidden + 255) / 256;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < tokens * oc; it++) { /* a token's pairs in expert order, summed from zero */
        const int64_t t = it / oc, i0 = it % oc * 256, i1 = i0 + 256 < hidden ? i0 + 256 : hidden;
        int64_t order[64];
        int64_t n = 0;
        for (int64_t j = 0; j < K; j++) { /* insertion by expert id: k is a handful */
            const int64_t pair = t * K + j;
            int64_t at = n++;
            while (at > 0 && ids[order[at - 1]] > ids[pair]) order[at] = order[at - 1], at--;
            order[at] = pair;
        }
        float *o = out + t * hidden;
        for (int64_t i = i0; i < i1; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const int64_t pair = order[j];
            const float wt = weights[pair], *y = w.ye + w.pos_of[pair] * hidden;
            const float *b = ex->down_bias ? ex->down_bias + ids[pair] * hidden : 0;
            for (int64_t i = i0; i < i1; i++) o[i] += (y[i] + (b ? b[i] : 0.0f)) * wt;
        }
    }
}

/* x [tokens, hidden]; ids, weights [tokens, top_k]; gate_up[e], down[e]: the addresses of expert e's blocks
   (types[0], types[1] their types, alike for every expert); biases [experts, 2 inter] and [experts, hidden] or
   NULL; relu2: up rows alone, relu². out [tokens, hidden] is overwritten. Returns 0, -1 (a type or shape not served), -2 (no memory). */
int pagedserve_moe_experts(const float *x, int64_t tokens, int32_t top_k, const int64_t *ids, const float *weights,
                           const int64_t *gate_up, const int64_t *down, const int32_t *types, const float *gate_up_bias,
                           const float *down_bias, int64_t experts, int64_t hidden, int64_t inter, float limit,
                           float alpha, int32_t relu2, int32_t bits8, float *out) {
    const PsExperts ex = {0, 0, 0, gate_up, down, gate_up_bias, down_bias, types[0], types[1], (int32_t)experts,
                          top_k, (int32_t)inter, 0, 0, relu2, 1, 1, 0, 0.0f, 1.0f, limit, alpha};
    if (pagedserve_moe_checks(&ex, hidden)) return -1;
    for (int64_t i = 0; i < tokens * top_k; i++)
        if (ids[i] < 0 || ids[i] >= experts) return -1;
    void *work = aligned_alloc(64, (size_t)pagedserve_moe_work_bytes(&ex, hidden, tokens));
    if (!work) return -2;
#pragma omp parallel
    pagedserve_moe_stages(&ex, hidden, x, tokens, ids, weights, bits8, out, work);
    free(work);
    return 0;
}
