/* A whole decode step of a Llama-family model on a CPU in one call: every layer of a few sequences' single
 * new tokens, from their embeddings to the final norm, inside one OpenMP parallel region.
 *
 * The layer-by-layer path (worker/model.py) makes ~10 calls a layer from Python (norm, QKV, RoPE, the K/V
 * write, attention, o_proj, norm, gate_up, SiLU-mul, down), each its own parallel region: at one sequence
 * that is ~300 thread wake-ups and as many trips through Python and torch's dispatcher, a third of the step
 * on the 135M default model. Here the threads stay up for the whole step and meet at a barrier after each
 * stage (the implicit one at the end of each `omp for`), every stage split over them:
 *   add + RMSNorm (rows) -> QKV matmul (output rows) -> bias, q/k RMSNorm, RoPE, K/V write (heads)
 *   -> attention (sequence x KV head, decode_item of paged_decode.c) -> o_proj -> add + RMSNorm -> gate_up
 *   -> SiLU-mul (chunks) -> down, and after the last layer the final add + RMSNorm.
 * The arithmetic is the layer path's: the matmuls are quant_blocks.h's dot products (GGUF blocks, or plain
 * fp32 rows as type 0) or packed_blocks.h's on weights packed at load (their input rounded to 16-bit integers
 * first, a stage of its own) — or, past gemm_rows tokens, a BLAS sgemm on the matrix's plain fp32 copy, called
 * by each thread on its share of the output rows — the norms, RoPE and SiLU are elementwise.c's formulas,
 * attention is the same kernel. Rows of a LoRA adapter get its update after each projection (lora_rows.h).
 * A hybrid's stateful layer (Mamba2, Gated DeltaNet, an LFM short conv) runs its mixer in attention's place,
 * in_proj and out_proj where qkv and o_proj are, its state advanced in the sequence's slot of the state pool.
 * A mixture-of-experts MLP is routed in the step and its chosen experts run in moe_experts.c's stages (the layer
 * path's own), beside the layer's shared expert where it has one. gpt-oss's sinks join every softmax (a drafting
 * run's rows then attend through pagedserve_prefill_rows, which reads them) and its o_proj bias is added. OLMo 3's
 * and MiniMax-M2's q and k are normed over each token's whole projection before the heads' RoPE, and OLMo 3's
 * blocks take the residual stream unnormed (no input norm), their outputs normed before the add.
 * No tensor parallelism here (a rank would all-reduce between stages): the worker runs it at TP=1.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_bf16.h"
#include "bf16_dots.h"
#include "pagedserve.h"
#include "packed_blocks.h"
#include "quant_blocks.h"
#include "kv_rows.h"
#include "lora_rows.h"
#include "rows.h"

#define OUT_CHUNK 32 /* output rows a thread takes at a time */

/* The step's own profile (pagedserve_decode_profile): thread 0, just past a stage's closing barrier, adds
   the time since the previous stage ended to this one. Off, a stage costs a load and a branch. */
static int prof_on;
static double prof_s[PS_DECODE_STAGES];
static int64_t prof_steps;

static inline void stage_done(int stage, double* prof_t) {
    if (prof_on && omp_get_thread_num() == 0) {
        const double t = omp_get_wtime();
        prof_s[stage] += t - *prof_t;
        *prof_t = t;
    }
}

int pagedserve_decode_profile(int32_t on, int64_t* out) {
    for (int s = 0; s < PS_DECODE_STAGES; s++) {
        if (out) out[s] = (int64_t)(prof_s[s] * 1e9);
        prof_s[s] = 0.0;
    }
    if (out) out[PS_DECODE_STAGES] = prof_steps;
    prof_steps = 0;
    prof_on = on != 0;
    return PS_DECODE_STAGES;
}

/* The widest of each buffer between stages over the model's layers: a Mamba2 layer's in_proj output, its
   mixer's output and conv output beside attention's qkv and attention's output. */
typedef struct {
    int64_t proj, mix, conv, max_in;
} StepWidths;

static StepWidths step_widths(const PsModel* m) {
    const int64_t h = m->hidden, q = (int64_t)m->n_heads * m->head_dim, i = m->intermediate;
    StepWidths w = {q + 2 * (int64_t)m->n_kv_heads * m->head_dim, q, 0, h > q ? (h > i ? h : i) : (q > i ? q : i)};
    for (int li = 0; li < 2 * m->num_layers; li++) { /* each layer, then each one's mixer beside */
        const PsLayer* ly = li < m->num_layers ? &m->layers[li] : m->layers[li - m->num_layers].beside;
        if (!ly) continue;
        const PsMamba* mb = ly->mamba;
        const PsDelta* dl = ly->delta;
        int64_t proj = w.proj, mix = 0, conv = 0;
        if (mb) {
            mix = (int64_t)mb->heads * mb->head_dim;
            conv = mix + 2 * (int64_t)mb->groups * mb->d_state;
            proj = mix + conv + mb->heads;
        } else if (dl) {
            mix = (int64_t)dl->v_heads * dl->dv;
            conv = 2 * (int64_t)dl->k_heads * dl->dk + mix;
            proj = conv + mix + 2 * (int64_t)dl->v_heads;
        } else if (ly->conv) {
            mix = ly->conv->channels;
            proj = 3 * mix;
        } else if (ly->attn_gate) {
            proj = q + 2 * (int64_t)m->n_kv_heads * m->head_dim + (ly->attn_gate == 2 ? m->n_heads : q);
        }
        w.proj = w.proj > proj ? w.proj : proj;
        w.mix = w.mix > mix ? w.mix : mix;
        w.conv = w.conv > conv ? w.conv : conv;
        w.max_in = w.max_in > mix ? w.max_in : mix;
    }
    return w;
}

/* Bytes a step of `rows` tokens needs for its widest mixture of experts: each row's scores, chosen ids and
   weights, the experts' output beside a shared expert's, the stages' work (each part 64-byte aligned). */
static int64_t moe_bytes(const PsModel* m, int64_t rows) {
    int64_t most = 0;
    for (int li = 0; li < m->num_layers; li++) {
        const PsExperts* ex = m->layers[li].experts;
        if (!ex) continue;
        const int64_t b = (rows * ex->experts * 4 + 63) / 64 * 64 + (rows * ex->top_k * 12 + 63) / 64 * 64
                          + rows * m->hidden * 4 + pagedserve_moe_work_bytes(ex, m->hidden, rows);
        most = b > most ? b : most;
    }
    return most;
}

/* the sizes of the structs the binding builds (pagedserve.h), for it to check its mirrors against */
int pagedserve_struct_sizes(int64_t* out) {
    out[0] = sizeof(PsSegment);
    out[1] = sizeof(PsMatrix);
    out[2] = sizeof(PsLayer);
    out[3] = sizeof(PsModel);
    out[4] = sizeof(PsLoraProj);
    out[5] = sizeof(PsLora);
    out[6] = sizeof(PsExperts);
    return 7;
}

/* floats of scratch a step of `rows` tokens needs: the activations between stages, and a matmul's input
   rounded for packed weights (64-byte aligned) */
int64_t pagedserve_decode_step_scratch(const PsModel* m, int64_t rows) {
    const StepWidths w = step_widths(m);
    return rows * (4 * (int64_t)m->hidden + w.proj + 2 * w.mix + w.conv + 3 * (int64_t)m->intermediate)
           + (packed_x_bytes(rows, packed_x_pitch(w.max_in)) + 128) / (int64_t)sizeof(float)
           + (moe_bytes(m, rows) + 64) / (int64_t)sizeof(float) + (amx_x_bytes(rows, w.max_in) + 64) / (int64_t)sizeof(float);
}

/* y = x @ W^T on the dense copy through sgemm, the output rows in as many equal chunks (of whole 16s) as
   the threads can share evenly with each at most GEMM_CHUNK: column-major, y^T[out, rows] = W[out, in] x^T. */
#define GEMM_CHUNK 2048
static void gemm_part(SgemmFn sgemm, const PsMatrix* w, const float* x, int64_t rows, float* y, const LoraAt* la) {
    const int64_t out_dim = w->out_dim, threads = omp_get_num_threads();
    const int64_t per_thread = (out_dim + threads * GEMM_CHUNK - 1) / (threads * GEMM_CHUNK);
    int64_t size = (out_dim + threads * per_thread - 1) / (threads * per_thread);
    size = (size + 15) / 16 * 16;
    const int64_t chunks = (out_dim + size - 1) / size;
    const int k = (int)w->in_dim, n = (int)rows, ldc = (int)out_dim;
    const float one = 1.0f, zero = 0.0f;
    const int64_t extra = lora_shrink_items(la);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = -extra; c < chunks; c++) {
        if (c < 0) {
            lora_shrink_item(la, x, k, c + extra);
            continue;
        }
        const int64_t o0 = c * size;
        const int mc = (int)(o0 + size < out_dim ? size : out_dim - o0);
        sgemm("T", "N", &mc, &n, &k, &one, w->dense + o0 * k, &k, x, &k, &zero, y + o0, &ldc);
    }
}

static int has_packed(const PsMatrix* w) {
    for (int s = 0; s < PS_MAX_SEGMENTS; s++)
        if (w->seg[s].rows && pack_block_bytes(w->seg[s].type)) return 1;
    return 0;
}

/* Whether a matrix has BF16 segments this step multiplies at bf16-rounded activations: on AMX tiles (segments of
   at least 16 rows) or AVX512_BF16 dot products; px.tiles is the scratch for x rounded. */
static int has_bf16_rounded(const PsMatrix* w, PackedX px, int64_t min_rows) {
    if (!px.tiles || !amx_shape(w->in_dim)) return 0;
    for (int s = 0; s < PS_MAX_SEGMENTS; s++)
        if (w->seg[s].rows >= min_rows && w->seg[s].type == BF16) return 1;
    return 0;
}

/* y[r, :] = x[r, :] @ W^T for this thread's share of W's rows (called by every thread of the region). A
   matrix with packed segments first rounds x into px, split over the threads (one more barrier). */
static void matmul_part(const PsModel* m, const PsMatrix* w, const float* x, int64_t rows, float* y, PackedX px,
                        int stage, double* prof_t, const LoraAt* la) {
    const int64_t nblocks = w->in_dim / QK, out_dim = w->out_dim;
    const int64_t chunks = (out_dim + OUT_CHUNK - 1) / OUT_CHUNK;
    if (m->sgemm && w->dense && rows > m->gemm_rows) {
        gemm_part(m->sgemm, w, x, rows, y, la);
        stage_done(stage, prof_t);
        return;
    }
    if (has_packed(w)) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * nblocks; i++) packed_x_block(x, px, i, nblocks);
        stage_done(PS_ROUNDING, prof_t);
    }
    const int amx = amx_bf16_ready() && has_bf16_rounded(w, px, AMX_ROWS);
#if BF16_DOTS
    const int dots = bf16_dots_ready() && has_bf16_rounded(w, px, 1);
    if (dots) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) dots_x_row(x, rows, w->in_dim, px.tiles, r);
        stage_done(PS_ROUNDING, prof_t);
    }
#endif
#ifdef AMX_BF16
    if (amx) {
        const int64_t tiles = (rows + AMX_ROWS - 1) / AMX_ROWS * (w->in_dim / AMX_K);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) amx_x_tile(x, rows, w->in_dim, px.tiles, t);
        stage_done(PS_ROUNDING, prof_t);
        amx_begin();
    }
#endif
    const int64_t extra = lora_shrink_items(la); /* the adapters' shrink first, beside the chunks */
    /* guided: each thread streams one contiguous share first, then shrinking runs (a vCPU the host takes away
       does not hold the other); single chunks handed out in turn broke each thread's stream every 36 KB, and
       one stream's matrices ran at 74-91% of a plain read against 98-101% so (docs/BENCHMARKS.md) */
#pragma omp for schedule(guided)
    for (int64_t c = -extra; c < chunks; c++) {
        if (c < 0) {
            lora_shrink_item(la, x, w->in_dim, c + extra);
            continue;
        }
        const int64_t o1 = (c + 1) * OUT_CHUNK < out_dim ? (c + 1) * OUT_CHUNK : out_dim;
        for (int64_t o = c * OUT_CHUNK; o < o1; o++) {
            int s = 0;
            int64_t first = 0; /* the segment's first row */
            while (o >= first + w->seg[s].rows) first += w->seg[s++].rows;
            const PsSegment* g = &w->seg[s];
            if (pack_block_bytes(g->type)) { /* whole groups, each by the chunk holding its first row */
                const int64_t off = (o - first) % PACK_ROWS;
                if (off) {
                    o += PACK_ROWS - off - 1;
                    continue;
                }
                float out[PACK_TILE * PACK_ROWS];
                const uint8_t* grp = g->w + (o - first) / PACK_ROWS * nblocks * pack_block_bytes(g->type);
                for (int64_t r0 = 0; r0 < rows; r0 += PACK_TILE) {
                    const int64_t nr = rows - r0 < PACK_TILE ? rows - r0 : PACK_TILE;
                    const int64_t pitch = packed_x_pitch(w->in_dim);
                    packed_group_dot(g->type, grp, nblocks, packed_x_rows(px, r0, pitch), pitch, nr, out);
                    for (int64_t r = 0; r < nr; r++)
                        for (int i = 0; i < PACK_ROWS; i++) y[(r0 + r) * out_dim + o + i] = out[r * PACK_ROWS + i];
                }
                o += PACK_ROWS - 1;
                continue;
            }
#ifdef AMX_BF16
            /* a BF16 segment's whole groups of 16 on tiles, each by the chunk holding its first row */
            const int64_t whole = g->rows / AMX_ROWS * AMX_ROWS;
            if (amx && g->type == BF16 && o - first < whole) {
                const int64_t off = (o - first) % AMX_ROWS;
                if (!off)
                    amx_group((const uint16_t*)g->w + (o - first) * w->in_dim, w->in_dim, px.tiles, rows, y, out_dim, o);
                o += AMX_ROWS - off - 1;
                continue;
            }
#endif
#if BF16_DOTS
            if (dots && g->type == BF16) { /* to the segment's or chunk's end */
                const int64_t end = first + g->rows < o1 ? first + g->rows : o1;
                o = dots_span((const uint16_t*)g->w + (o - first) * w->in_dim, w->in_dim, px.tiles, rows, o, end, y,
                              out_dim, first + g->rows) - 1;
                continue;
            }
#endif
#if WIDE_ROWS
            if (widened_type(g->type)) { /* half-width rows, several a pass, to the segment's or chunk's end */
                const int64_t end = first + g->rows < o1 ? first + g->rows : o1;
                o = widened_span(g->type, g->w + (o - first) * row_bytes(g->type, w->in_dim), w->in_dim, x, rows, o,
                                 end, y, out_dim) - 1;
                continue;
            }
#endif
            const uint8_t* wrow = g->w + (o - first) * row_bytes(g->type, w->in_dim);
            float acc[ROWS];
            for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                const int nr = (int)(rows - r0 < ROWS ? rows - r0 : ROWS);
                rows_dot(g->type, wrow, nblocks, x + r0 * w->in_dim, w->in_dim, nr, acc);
                for (int r = 0; r < nr; r++) y[(r0 + r) * out_dim + o] = acc[r];
            }
        }
    }
#ifdef AMX_BF16
    if (amx) amx_end();
#endif
    (void)amx;
    stage_done(stage, prof_t);
}

static int matrix_served(const PsMatrix* w, int64_t out_dim, int64_t in_dim) {
    int64_t total = 0;
    for (int s = 0; s < PS_MAX_SEGMENTS; s++) {
        if (w->seg[s].rows == 0) continue;
        if (pack_block_bytes(w->seg[s].type)) {
            if (w->seg[s].rows % PACK_ROWS || in_dim % QK) return 0;
        } else if (!block_bytes(w->seg[s].type) || in_dim % block_values(w->seg[s].type) || w->seg[s].rows < 0) {
            return 0;
        }
        total += w->seg[s].rows;
    }
    return total == out_dim && w->out_dim == out_dim && w->in_dim == in_dim;
}

/* Whether two rows' tables name the same blocks for the first `len` keys. */
static int same_table(const int32_t* a, const int32_t* b, int32_t len, int32_t block_size) {
    for (int32_t i = 0; i < (len + block_size - 1) / block_size; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* One head of one token in place: bias, RMSNorm over the head (q/k norm), rotate-half RoPE over its first
   2 * rotary_half values. */
static void head_prologue(float* v, const float* bias, const float* norm, const float* c, const float* s,
                          int head_dim, int rotary_half, float eps) {
    if (bias)
        for (int d = 0; d < head_dim; d++) v[d] += bias[d];
    if (norm) add_rms_norm_row(v, 0, norm, v, head_dim, eps); /* in place: each value read before written */
    if (c) rope_head(v, c, s, rotary_half);
}

/* add_rms_norm_row, or with no norm (OLMo 3's layers) the sum itself as out */
static inline void add_norm_row(float* x, const float* delta, const float* weight, float* out, int64_t dim, float eps) {
    if (weight) {
        add_rms_norm_row(x, delta, weight, out, dim, eps);
        return;
    }
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] += delta ? delta[i] : 0.0f;
}

/* A block's output as the layer path adds it to the residual: RMS-normed where the layer norms it (Gemma's
   sandwich), then times the model's residual scale (Granite). */
static inline void block_out(float* v, int64_t n, const float* norm, const PsModel* m) {
    if (norm) add_rms_norm_row(v, 0, norm, v, n, m->eps); /* in place: each value read before written */
    if (m->residual_scale == 1.0f) return;
    for (int64_t i = 0; i < n; i++) v[i] *= m->residual_scale;
}

/* A Mamba2 layer's mixer between in_proj (proj, [rows, in_proj rows]) and out_proj (mixed), as the layer path's
   pagedserve_mamba_decode, its stages split over the step's threads. */
static void mamba_stages(const PsMamba* mb, const float* proj, int64_t rows, const int64_t* state_slots,
                         float* conv_out, float* y, float* mixed, double* prof_t) {
    const int64_t inner = (int64_t)mb->heads * mb->head_dim, conv_dim = inner + 2 * (int64_t)mb->groups * mb->d_state;
    pagedserve_mamba_stages(mb, proj, inner + conv_dim + mb->heads, state_slots, rows, conv_out, y, mixed);
    stage_done(PS_MAMBA, prof_t);
}

/* A short-conv layer's mixer between in_proj (proj, [rows, 3 channels]: B, C, x) and out_proj (out): B x
   through the depthwise causal conv, each row's state moved on by one in its slot, times C; chunks of channels
   over the threads. */
static void short_conv_stage(const PsConv* sc, const float* proj, int64_t rows, const int64_t* slots, float* out,
                             double* prof_t) {
    const int64_t ch = sc->channels, K = sc->kernel, chunks = (ch + PS_MAMBA_CONV_CHUNK - 1) / PS_MAMBA_CONV_CHUNK;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows * chunks; it++) {
        const int64_t r = it / chunks, c0 = it % chunks * PS_MAMBA_CONV_CHUNK;
        const int64_t c1 = c0 + PS_MAMBA_CONV_CHUNK < ch ? c0 + PS_MAMBA_CONV_CHUNK : ch;
        const float *b = proj + r * 3 * ch, *c = b + ch, *x = c + ch;
        float* st = sc->conv_states + slots[r] * (K - 1) * ch;
        for (int64_t i = c0; i < c1; i++) {
            const float* w = sc->conv + i * K;
            const float bx = b[i] * x[i];
            float acc = 0.0f;
            for (int64_t j = 0; j < K - 1; j++) acc += w[j] * st[j * ch + i];
            acc += w[K - 1] * bx;
            for (int64_t j = 0; j + 1 < K - 1; j++) st[j * ch + i] = st[(j + 1) * ch + i];
            st[(K - 2) * ch + i] = bx;
            out[r * ch + i] = c[i] * acc;
        }
    }
    stage_done(PS_MAMBA, prof_t);
}

/* Falcon-H1's Mamba2 beside an attention layer: the mixer alone, its in_proj and out_proj served. */
static int beside_served(const PsModel* m, const PsLayer* ly, const PsLora* lora, const int64_t* state_slots) {
    const PsLayer* bs = ly->beside;
    const PsMamba* mb = bs->mamba;
    if (!mb || bs->beside || bs->gate_up.out_dim || ly->mamba || ly->delta || ly->conv || lora || !state_slots
        || pagedserve_mamba_checks(mb))
        return 0;
    const int64_t inner = (int64_t)mb->heads * mb->head_dim;
    return matrix_served(&bs->qkv, 2 * inner + 2 * (int64_t)mb->groups * mb->d_state + mb->heads, m->hidden)
           && matrix_served(&bs->o_proj, m->hidden, inner);
}

/* Whether the step serves every layer's shape: its matrices (of the halves it has), its mixer's state. */
static int layers_served(const PsModel* m, const PsLora* lora, const int64_t* state_slots) {
    const int64_t H = m->hidden, I = m->intermediate, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads;
    const int64_t qsz = nh * hd, kvsz = nkv * hd, qkv_w = qsz + 2 * kvsz;
    if (lora && m->gelu == 2) return 0; /* an ungated MLP's up: no adapter's gate_up */
    for (int i = 0; i < m->num_layers; i++) {
        const PsLayer* ly = &m->layers[i];
        const PsMamba* mb = ly->mamba;
        const PsMatrix* mats[4] = {&ly->qkv, &ly->o_proj, &ly->gate_up, &ly->down};
        int64_t shapes[4][2] = {{qkv_w, H}, {H, qsz}, {(m->gelu == 2 ? 1 : 2) * I, H}, {H, I}};
        const int mixer = ly->qkv.out_dim > 0, mlp = ly->gate_up.out_dim > 0; /* Nemotron-H: one alone */
        if (!(mixer || mlp || ly->experts) || (lora && !(mixer && mlp)) || (!mixer && (mb || ly->delta || ly->conv)))
            return 0;
        /* experts (and their shared expert, if any): SiLU-gated, or relu² beside relu² MLPs; no adapters */
        if (ly->experts && (lora || m->gelu != 2 * ly->experts->relu2 || pagedserve_moe_checks(ly->experts, H)))
            return 0;
        if (ly->shared_gate && !(ly->experts && mlp)) return 0;
        if (mb) { /* in_proj and out_proj where attention's qkv and o_proj are; no adapters on them */
            if (pagedserve_mamba_checks(mb) || !state_slots || lora) return 0;
            const int64_t inner = (int64_t)mb->heads * mb->head_dim;
            shapes[0][0] = 2 * inner + 2 * (int64_t)mb->groups * mb->d_state + mb->heads;
            shapes[1][1] = inner;
        } else if (ly->delta) {
            const PsDelta* dl = ly->delta;
            if (pagedserve_delta_checks(dl) || !state_slots || lora) return 0;
            const int64_t v_size = (int64_t)dl->v_heads * dl->dv;
            shapes[0][0] = 2 * (int64_t)dl->k_heads * dl->dk + 2 * v_size + 2 * (int64_t)dl->v_heads;
            shapes[1][1] = v_size;
        } else if (ly->conv) {
            const PsConv* sc = ly->conv;
            if (!sc->conv || !sc->conv_states || sc->kernel < 2 || sc->channels != H || !state_slots || lora)
                return 0;
            shapes[0][0] = 3 * H;
            shapes[1][1] = H;
        } else if (ly->attn_gate) { /* q, k, v, then a gate a query value or a query head */
            if (lora || ly->attn_gate > 2) return 0;
            shapes[0][0] += ly->attn_gate == 2 ? nh : qsz;
        }
        for (int j = mixer ? 0 : 2; j < (mlp ? 4 : 2); j++)
            if (!matrix_served(mats[j], shapes[j][0], shapes[j][1])) return 0;
        if (ly->beside && !beside_served(m, ly, lora, state_slots)) return 0;
    }
    return 1;
}

/* The output norm of a layer's last half, pending until the next layer (or the final norm) adds it. */
static inline const float* pending_norm(const PsModel* m, int li) {
    const PsLayer* ly = &m->layers[li];
    return ly->gate_up.out_dim > 0 || ly->experts ? ly->mlp_out_norm : ly->attn_out_norm;
}

/* A mixture-of-experts MLP on h (the normed rows): each row's experts chosen, their output into out; where the
   layer has a shared expert, its output (shared, already computed) is added to the experts', times the sigmoid of
   shared_gate . h where the layer gates it, as the layer path adds them. mem: moe_bytes. */
static void experts_stage(const PsModel* m, const PsLayer* ly, const float* h, int64_t rows, char* mem,
                          const float* shared, float* out, double* prof_t) {
    const PsExperts* ex = ly->experts;
    const int64_t H = m->hidden, E = ex->experts, K = ex->top_k;
    float* scores = (float*)mem;
    int64_t* ids = (int64_t*)(mem + (rows * E * 4 + 63) / 64 * 64);
    float* weights = (float*)(ids + rows * K);
    float* own = (float*)((char*)ids + (rows * K * 12 + 63) / 64 * 64); /* beside a shared expert */
    pagedserve_moe_route(ex, H, h, rows, ids, weights, scores);
    pagedserve_moe_stages(ex, H, h, rows, ids, weights, m->x8, shared ? own : out, (char*)own + rows * H * 4);
    stage_done(PS_EXPERTS, prof_t);
    if (!shared) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float g = 1.0f;
        if (ly->shared_gate) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < H; i++) acc += ly->shared_gate[i] * h[r * H + i];
            g = 1.0f / (1.0f + expf(-acc));
        }
        for (int64_t i = 0; i < H; i++) out[r * H + i] = own[r * H + i] + (ly->shared_gate ? g * shared[r * H + i] : shared[r * H + i]);
    }
    stage_done(PS_EXPERTS, prof_t);
}

/* x: [rows, hidden], the tokens' embeddings in, the final-norm hidden states out. positions, slots: int64
 * [rows]; block_tables: int32 [rows, table_stride]; seq_lens: int32 [rows] (this token included). scratch:
 * pagedserve_decode_step_scratch floats. Returns 0, or -1 for a shape the step does not serve. */
int pagedserve_decode_step(const PsModel* m, int64_t rows, float* x, const int64_t* positions, const int64_t* slots,
                           const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                           const PsLora* lora, const int64_t* state_slots, float* scratch) {
    const int64_t H = m->hidden, I = m->intermediate, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads;
    const int64_t qsz = nh * hd, kvsz = nkv * hd, qkv_w = qsz + 2 * kvsz;
    if (rows < 1 || H % QK || I % QK || qsz % QK || hd % 2 || nkv < 1 || nh % nkv || m->rotary_half < 1
        || 2 * m->rotary_half > hd)
        return -1;
    if (!layers_served(m, lora, state_slots)) return -1;
    const StepWidths widths = step_widths(m);
    LoraRuns lr;
    const int64_t out_dims[4] = {qkv_w, H, 2 * I, H};
    if (lora_runs(lora, m->num_layers, out_dims, rows, &lr)) {
        lora_runs_free(&lr);
        return -1;
    }
    float* residual = scratch;
    float* h = residual + rows * H;
    float* delta = h + rows * H;
    float* beside = delta + rows * H; /* Falcon-H1's Mamba2 output, to add to attention's */
    float* qkv = beside + rows * H; /* attention's q, k, v, or a Mamba2 layer's in_proj output */
    float* attn = qkv + rows * widths.proj; /* attention's output, or the Mamba2 state-space step's */
    float* mixed = attn + rows * widths.mix; /* a Mamba2 layer's gated norm (out_proj's input) */
    float* conv_out = mixed + rows * widths.mix;
    float* gu = conv_out + rows * widths.conv;
    float* act = gu + rows * 2 * I;
    const int64_t heads = nh + nkv;
    const int64_t half = m->rotary_half;
    const int64_t act_chunks = (I + 255) / 256;
    float* packed = act + rows * I;
    packed = (float*)(((uintptr_t)packed + 63) & ~(uintptr_t)63);
    PackedX px = packed_x_at(packed, rows, packed_x_pitch(widths.max_in));
    px.bits8 = m->x8;
    /* x as AMX tiles (amx_bf16.h) or rounded rows (bf16_dots.h) for BF16 matrices, past the experts' memory */
    px.tiles = amx_bf16_ready() || bf16_dots_ready()
                   ? (uint16_t*)(((uintptr_t)packed + (uintptr_t)packed_x_bytes(rows, packed_x_pitch(widths.max_in))
                                  + 63 + (uintptr_t)moe_bytes(m, rows) + 63)
                                 & ~(uintptr_t)63)
                   : 0;
    /* the mixtures of experts' scores, choices, output and work (moe_bytes) */
    char* moe_mem = (char*)(((uintptr_t)packed + (uintptr_t)packed_x_bytes(rows, packed_x_pitch(widths.max_in)) + 63)
                            & ~(uintptr_t)63);
    /* attention work items: a sequence with all its KV heads (each key and value row read whole, in one pass)
       where there are sequences enough to keep every thread busy, else one KV head of a sequence */
    /* Runs of rows that are one sequence's consecutive tokens (a drafting sequence's: the same table, each row
       one key longer): their keys are read once for the run (pagedserve_prefill_rows), not once a row. Rows
       with equal tables over the keys they read and consecutive lengths attend alike however they came. */
    int64_t runs = 0;
    int32_t* run_start = malloc(sizeof(int32_t) * 4 * rows);
    if (run_start == 0) {
        lora_runs_free(&lr);
        return -1;
    }
    int32_t* run_len = run_start + rows;
    int32_t* part_start = run_len + rows; /* the runs cut into parts, each a work item with every KV head */
    int32_t* part_len = part_start + rows;
    for (int64_t r = 0; r < rows; r++) {
        if (runs && seq_lens[r] == seq_lens[r - 1] + 1 && same_table(block_tables + (r - 1) * table_stride,
                                                                      block_tables + r * table_stride, seq_lens[r],
                                                                      m->block_size)) {
            run_len[runs - 1]++;
            continue;
        }
        run_start[runs] = (int32_t)r;
        run_len[runs++] = 1;
    }
    /* A run is cut into parts of equal rows: no more rows than one call's state holds (a longer run would
       read its keys again for the rows past it anyway), and parts enough that a step of few runs gives every
       thread work: a lone drafting sequence of a model with 3 KV heads is 3 items on 2 threads uncut (one
       thread idle a third of the attention), 6 cut in two. Each part reads the run's keys once. */
    int64_t parts = 0;
    {
        const int64_t per = pagedserve_decode_run_rows((int)nh, (int)nkv);
        const int64_t want = (2 * (int64_t)omp_get_max_threads() + runs * nkv - 1) / (runs * nkv);
        for (int64_t u = 0; u < runs; u++) {
            const int64_t n = run_len[u];
            int64_t c = n == 1 ? 1 : (n + per - 1) / per;
            if (n > 1 && c < want) c = want < n ? want : n;
            for (int64_t j = 0; j < c; j++) { /* rows [n * j / c, n * (j + 1) / c) of the run */
                part_start[parts] = run_start[u] + (int32_t)(n * j / c);
                part_len[parts++] = (int32_t)(n * (j + 1) / c - n * j / c);
            }
        }
    }

    /* few sequences, none part of a run: each one's keys cut into ranges, as pagedserve_paged_decode does */
    int32_t shortest = rows ? seq_lens[0] : 0;
    for (int64_t r = 1; r < rows; r++) shortest = seq_lens[r] < shortest ? seq_lens[r] : shortest;
    int att_splits = runs == rows ? pagedserve_decode_splits((int32_t)rows, shortest, m->block_size) : 1;
    const int64_t row_state = att_splits * nh * (hd + 2); /* a row's ranges' states: accumulators, maxima, sums */
    float* att_state = att_splits > 1 ? malloc(sizeof(float) * (size_t)(rows * row_state)) : 0;
    if (att_state == 0) att_splits = 1;
    const int64_t att_heads = att_splits > 1 || rows >= 4 * omp_get_max_threads()
                                  ? pagedserve_decode_heads_per_item((int)nh, (int)nkv, (int)hd)
                                  : 1;
    const int64_t att_split = (nkv + att_heads - 1) / att_heads;

    double prof_t = prof_on ? omp_get_wtime() : 0.0; /* the profile's clock (thread 0's) */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < H; i++) residual[r * H + i] = x[r * H + i];
        for (int li = 0; li < m->num_layers; li++) {
            const PsLayer* ly = &m->layers[li];
            LoraAt la = {lora, &lr, m->num_layers, li, 0}; /* the LoRA stage's place (NULL: no adapter) */
            const LoraAt* lq = lr.n ? &la : 0;
            const int has_mixer = ly->qkv.out_dim > 0, has_mlp = ly->gate_up.out_dim > 0;
            if (has_mixer) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) {
                    if (li) block_out(delta + r * H, H, pending_norm(m, li - 1), m);
                    add_norm_row(residual + r * H, li ? delta + r * H : 0, ly->input_norm, h + r * H, H, m->eps);
                }
                stage_done(PS_NORMS, &prof_t);
                la.which = 0;
                matmul_part(m, &ly->qkv, h, rows, qkv, px, PS_QKV, &prof_t, lq);
                if (lq) {
                    lora_expand(lq, qkv, qkv_w);
                    stage_done(PS_LORA, &prof_t);
                }
                const int64_t lw = qkv_w + (ly->attn_gate == 2 ? nh : ly->attn_gate ? qsz : 0); /* a qkv row */
                if (ly->conv) {
                    short_conv_stage(ly->conv, qkv, rows, state_slots, mixed, &prof_t);
                } else if (ly->mamba) {
                    mamba_stages(ly->mamba, qkv, rows, state_slots, conv_out, attn, mixed, &prof_t);
                } else if (ly->delta) {
                    const PsDelta* dl = ly->delta;
                    const int64_t v_size = (int64_t)dl->v_heads * dl->dv;
                    const int64_t stride = 2 * (int64_t)dl->k_heads * dl->dk + 2 * v_size + 2 * (int64_t)dl->v_heads;
                    pagedserve_delta_stages(dl, qkv, stride, state_slots, rows, conv_out, attn, mixed);
                    stage_done(PS_MAMBA, &prof_t);
                } else {
                    const int whole = ly->qk_whole; /* q's and k's bias and norm over the whole projection first */
                    if (whole) {
#pragma omp for schedule(static)
                        for (int64_t it = 0; it < rows * 2; it++) { /* a row's q, or its k */
                            const int64_t at = it % 2 ? qsz : 0, n = it % 2 ? kvsz : qsz;
                            float* v = qkv + it / 2 * lw + at;
                            if (ly->qkv_bias)
                                for (int64_t i = 0; i < n; i++) v[i] += ly->qkv_bias[at + i];
                            add_rms_norm_row(v, 0, it % 2 ? ly->k_norm : ly->q_norm, v, n, m->eps);
                        }
                    }
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < rows * heads; it++) { /* q heads, then k heads (each with its v head) */
                        const int64_t r = it / heads, hh = it % heads;
                        float* row = qkv + r * lw;
                        const int is_k = hh >= nh;
                        const float* c = ly->rope ? (ly->cos ? ly->cos : m->cos) + positions[r] * half : 0;
                        const float* s = ly->rope ? (ly->sin ? ly->sin : m->sin) + positions[r] * half : 0;
                        head_prologue(row + hh * hd, ly->qkv_bias && !whole ? ly->qkv_bias + hh * hd : 0,
                                      whole ? 0 : is_k ? ly->k_norm : ly->q_norm, c, s, (int)hd, (int)half, m->eps);
                        if (is_k) {
                            const int64_t kvh = hh - nh;
                            float* v = row + qsz + kvsz + kvh * hd;
                            head_prologue(v, ly->qkv_bias ? ly->qkv_bias + qsz + kvsz + kvh * hd : 0, 0, 0, 0, (int)hd, 0,
                                          m->eps);
                            if (slots[r] >= 0) {
                                const int64_t at = slots[r] * kvsz + kvh * hd;
                                kv_store(ly->k_cache, at, m->kv_bf16, row + hh * hd, (int)hd);
                                kv_store(ly->v_cache, at, m->kv_bf16, v, (int)hd);
                            }
                        }
                    }
                    stage_done(PS_HEADS, &prof_t);
                    if (att_splits > 1) {
#pragma omp for schedule(dynamic, 1)
                        for (int64_t it = 0; it < rows * att_splits * att_split; it++) { /* a range of a row's keys */
                            const int64_t r = it / (att_splits * att_split), j = it / att_split % att_splits;
                            const int kh0 = (int)(it % att_split * att_heads);
                            const int kh1 = kh0 + att_heads < nkv ? kh0 + att_heads : (int)nkv;
                            const int32_t first = ly->window > 0 && seq_lens[r] > ly->window ? seq_lens[r] - ly->window : 0;
                            int32_t from, to;
                            pagedserve_decode_range(first, seq_lens[r], m->block_size, att_splits, (int32_t)j, &from, &to);
                            float* acc = att_state + r * row_state + (j * nh + kh0 * (nh / nkv)) * hd;
                            float* mx = att_state + r * row_state + att_splits * nh * hd + j * nh + kh0 * (nh / nkv);
                            pagedserve_decode_part(qkv + r * lw, ly->k_cache, ly->v_cache, block_tables + r * table_stride,
                                                   from, to, kh0, kh1, (int)nh, (int)nkv, (int)hd, m->block_size, m->scale,
                                                   m->softcap, m->kv_bf16, acc, mx, mx + att_splits * nh);
                        }
#pragma omp for schedule(static)
                        for (int64_t it = 0; it < rows * nh; it++) { /* the ranges merged, a query head at a time */
                            const int64_t r = it / nh, hh = it % nh;
                            const float* st = att_state + r * row_state;
                            const float* mx = st + att_splits * nh * hd + hh;
                            pagedserve_decode_merge(st + hh * hd, mx, mx + att_splits * nh, att_splits, nh * hd, nh, (int)hd,
                                                    ly->sinks ? ly->sinks + hh : 0, attn + r * qsz + hh * hd);
                        }
                    } else if (runs == rows) {
#pragma omp for schedule(dynamic, 1)
                        for (int64_t it = 0; it < rows * att_split; it++) { /* a sequence's KV heads and their query heads */
                            const int64_t r = it / att_split;
                            const int kh0 = (int)(it % att_split * att_heads);
                            const int kh1 = kh0 + att_heads < nkv ? kh0 + att_heads : (int)nkv;
                            const int32_t first = ly->window > 0 && seq_lens[r] > ly->window ? seq_lens[r] - ly->window : 0;
                            pagedserve_decode_item(qkv + r * lw, ly->k_cache, ly->v_cache, attn + r * qsz,
                                                   block_tables + r * table_stride, first, seq_lens[r], kh0, kh1, (int)nh,
                                                   (int)nkv, (int)hd, m->block_size, m->scale, m->softcap, ly->sinks, m->kv_bf16);
                        }
                    } else {
#pragma omp for schedule(dynamic, 1)
                        for (int64_t it = 0; it < parts * nkv; it++) { /* a part of a sequence's run of rows, one KV head */
                            const int64_t u = it / nkv;
                            const int kh = (int)(it % nkv);
                            const int64_t r = part_start[u], n = part_len[u];
                            const int32_t last = seq_lens[r + n - 1];
                            if (n == 1) {
                                const int32_t first = ly->window > 0 && last > ly->window ? last - ly->window : 0;
                                pagedserve_decode_item(qkv + r * lw, ly->k_cache, ly->v_cache, attn + r * qsz,
                                                       block_tables + r * table_stride, first, last, kh, kh + 1, (int)nh,
                                                       (int)nkv, (int)hd, m->block_size, m->scale, m->softcap, ly->sinks, m->kv_bf16);
                            } else if (!ly->sinks && (ly->window <= 0 || last <= ly->window)) { /* every row sees every key */
                                pagedserve_decode_run(qkv + r * lw, lw, ly->k_cache, ly->v_cache, attn + r * qsz, qsz,
                                                      (int32_t)n, block_tables + r * table_stride, seq_lens[r], kh, (int)nh,
                                                      (int)nkv, (int)hd, m->block_size, m->scale, m->softcap, m->kv_bf16);
                            } else {
                                pagedserve_prefill_rows(qkv, lw, ly->k_cache, ly->v_cache, attn, r, (int32_t)n, last,
                                                        block_tables + r * table_stride, kh, (int)nh, (int)nkv, (int)hd,
                                                        m->block_size, m->scale, ly->window, m->softcap, ly->sinks, m->kv_bf16);
                            }
                        }
                    }
                    if (ly->attn_gate) { /* each query value (or head) times the sigmoid of its gate */
#pragma omp for schedule(static)
                        for (int64_t it = 0; it < rows * nh; it++) {
                            const int64_t r = it / nh, at = it % nh * hd;
                            const float* gt = qkv + r * lw + qsz + 2 * kvsz + (ly->attn_gate == 2 ? it % nh : at);
                            const int64_t step = ly->attn_gate == 2 ? 0 : 1;
                            float* o = attn + r * qsz + at;
                            for (int64_t d = 0; d < hd; d++) o[d] *= 1.0f / (1.0f + expf(-gt[d * step]));
                        }
                    }
                    stage_done(PS_ATTENTION, &prof_t);
                }
                la.which = 1;
                const float* mix_out = ly->mamba || ly->delta || ly->conv ? mixed : attn;
                matmul_part(m, &ly->o_proj, mix_out, rows, delta, px, PS_O_PROJ, &prof_t, lq);
                if (lq) {
                    lora_expand(lq, delta, H);
                    stage_done(PS_LORA, &prof_t);
                }
                if (ly->o_bias) {
#pragma omp for schedule(static)
                    for (int64_t r = 0; r < rows; r++)
                        for (int64_t i = 0; i < H; i++) delta[r * H + i] += ly->o_bias[i];
                    stage_done(PS_O_PROJ, &prof_t);
                }
                if (ly->beside) { /* Falcon-H1: Mamba2 on the same input, the two outputs summed */
                    const PsLayer* bs = ly->beside;
                    matmul_part(m, &bs->qkv, h, rows, qkv, px, PS_QKV, &prof_t, 0);
                    mamba_stages(bs->mamba, qkv, rows, state_slots, conv_out, attn, mixed, &prof_t);
                    matmul_part(m, &bs->o_proj, mixed, rows, beside, px, PS_O_PROJ, &prof_t, 0);
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < rows * H; i++) delta[i] += beside[i];
                    stage_done(PS_MAMBA, &prof_t);
                }
            }
            if (!has_mlp && !ly->experts) continue; /* its output pending for the next layer's add */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) { /* the residual add (of the mixer's, or the last layer's output) */
                const int pending = has_mixer || li;
                if (pending) block_out(delta + r * H, H, has_mixer ? ly->attn_out_norm : pending_norm(m, li - 1), m);
                add_norm_row(residual + r * H, pending ? delta + r * H : 0, ly->post_norm, h + r * H, H, m->eps);
            }
            stage_done(PS_NORMS, &prof_t);
            if (has_mlp) { /* a dense MLP, or the experts' shared one */
                la.which = 2;
                matmul_part(m, &ly->gate_up, h, rows, gu, px, PS_GATE_UP, &prof_t, lq);
                if (lq) {
                    lora_expand(lq, gu, 2 * I);
                    stage_done(PS_LORA, &prof_t);
                }
                const int64_t gw = m->gelu == 2 ? I : 2 * I; /* a row of gate_up's output: gate and up, or up */
#pragma omp for schedule(static)
                for (int64_t it = 0; it < rows * act_chunks; it++) {
                    const int64_t r = it / act_chunks, i0 = it % act_chunks * 256, i1 = i0 + 256 < I ? i0 + 256 : I;
                    if (m->gelu == 2) /* Nemotron-H's relu² of up alone */
                        for (int64_t i = i0; i < i1; i++) {
                            const float u = gu[r * gw + i] > 0.0f ? gu[r * gw + i] : 0.0f;
                            act[r * I + i] = u * u;
                        }
                    else
                        act_mul_span(gu + r * gw, gu + r * gw + I, act + r * I, i0, i1, m->gelu);
                }
                stage_done(PS_SILU, &prof_t);
                la.which = 3;
                matmul_part(m, &ly->down, act, rows, delta, px, PS_DOWN, &prof_t, lq);
                if (lq) {
                    lora_expand(lq, delta, H);
                    stage_done(PS_LORA, &prof_t);
                }
            }
            if (ly->experts) experts_stage(m, ly, h, rows, moe_mem, has_mlp ? delta : 0, delta, &prof_t);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            block_out(delta + r * H, H, pending_norm(m, m->num_layers - 1), m);
            add_rms_norm_row(residual + r * H, delta + r * H, m->final_norm, x + r * H, H, m->eps);
        }
        stage_done(PS_NORMS, &prof_t);
    }
    if (prof_on) prof_steps++;
    free(run_start);
    free(att_state);
    lora_runs_free(&lr);
    return 0;
}
