/* The native CPU library's public interface: every entry point, and the fused decode step's model
 * description. kernels/cpu_native.py reads the prototypes below to call them (one place says each
 * signature); every .c includes this header, so a definition that drifts from it does not compile. */
#ifndef PAGEDSERVE_H
#define PAGEDSERVE_H

#include <stdint.h>

/* --- what this build has --------------------------------------------------------------------------- */
int pagedserve_native_isa(void);
int pagedserve_packed_fast(void);
int pagedserve_packed_q8_fast(int bits8);
int pagedserve_prefill_bf16_dots(void);
int pagedserve_prefill_tiles(int32_t use);
int pagedserve_decode_limits(int32_t* out);
int pagedserve_prefill_limits(int32_t* out);
int pagedserve_struct_sizes(int64_t* out);

/* --- Gated DeltaNet's decode (delta_rule.c) --------------------------------------------------------- */
void pagedserve_conv_step(const float* x, int64_t x_stride, float* conv_states, const int64_t* slots,
                          const float* weight, const float* bias, float* out, int64_t rows, int32_t channels,
                          int32_t kernel);
int pagedserve_delta_rule_step(const float* x, int64_t x_stride, const float* g, const float* beta,
                               float* states, const int64_t* slots, float* out, int64_t rows, int32_t k_heads,
                               int32_t v_heads, int32_t dk, int32_t dv, int32_t tiled);
int pagedserve_delta_rule_chunked(const float* x, int64_t x_stride, const float* g, const float* beta,
                                  float* state, float* out, int64_t tokens, int32_t k_heads, int32_t v_heads,
                                  int32_t dk, int32_t dv, int32_t tiled, int32_t chunk);
void pagedserve_gated_norm(const float* o, const float* z, int64_t z_stride, const float* weight, float* out,
                           int64_t rows, int32_t heads, int32_t dim, float eps);

/* --- paged attention (paged_decode.c, paged_prefill.c) -------------------------------------------- */
void pagedserve_paged_decode(const float* q, const void* k_cache, const void* v_cache, float* out,
                             const int64_t* rows, const int32_t* block_tables, int64_t table_stride,
                             const int32_t* seq_lens, int32_t n, int32_t n_heads, int32_t n_kv_heads,
                             int32_t head_dim, int32_t block_size, float scale, int32_t window, float softcap,
                             const float* sinks, int32_t kv_bf16);
void pagedserve_paged_prefill(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                              float* out, const int64_t* starts, const int32_t* q_lens, const int32_t* seq_lens,
                              const int32_t* block_tables, int64_t table_stride, int32_t n, int32_t n_heads,
                              int32_t n_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                              int32_t window, float softcap, int32_t kv_bf16, int32_t bf16_dots,
                              const float* sinks);

/* --- the elementwise tail (elementwise.c) ---------------------------------------------------------- */
void pagedserve_add_rms_norm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                             int64_t dim, float eps);
void pagedserve_add_rms_norm_mixed(float* residual, const void* delta, int32_t delta_bf16, const float* weight,
                                   void* out, int32_t out_bf16, int64_t rows, int64_t dim, float eps);
void pagedserve_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter);
void pagedserve_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter);
void pagedserve_write_kv(const float* k, const float* v, int64_t row_stride, void* k_cache, void* v_cache,
                         const int64_t* slots, int64_t n, int32_t width, int32_t kv_bf16);
void pagedserve_widen_bf16(const uint16_t* src, float* dst, int64_t n);
void pagedserve_rope(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                     const float* cos_table, const float* sin_table, const int64_t* positions, int32_t half);
void pagedserve_head_rms_norm(float* x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                              const float* weight, float eps);
void pagedserve_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out);

/* --- matmuls on GGUF blocks (quant_matmul.c) ------------------------------------------------------- */
int pagedserve_pack(const uint8_t* w, int64_t out_dim, int64_t in_dim, int32_t type, uint8_t* out);
int pagedserve_quant_matmul(const float* x, int64_t rows, int64_t in_dim, const uint8_t* w, int64_t out_dim,
                            int32_t type, float* y);
int pagedserve_quant_matmul_q8act(const float* x, int64_t rows, int64_t in_dim, const uint8_t* w,
                                  int64_t out_dim, int32_t type, float* y);
/* A mixture-of-experts MLP's chosen experts for `tokens` rows of x, all in one parallel region (moe_experts.c). */
int pagedserve_moe_experts(const float* x, int64_t tokens, int32_t top_k, const int64_t* ids, const float* weights,
                           const int64_t* gate_up, const int64_t* down, const int32_t* types, const float* gate_up_bias,
                           const float* down_bias, int64_t experts, int64_t hidden, int64_t inter, float limit,
                           float alpha, int32_t relu2, int32_t bits8, float* out);
/* 1 (the default): BF16 rows at bf16-rounded activations where the CPU multiplies them so (AMX tiles, AVX512_BF16
   dot products); 0: the row kernel's fp32 activations; -1 asks. Returns 2 (tiles), 1 (dot products) or 0. */
int pagedserve_bf16_rounded(int32_t on);
int pagedserve_quant_dequant(const uint8_t* w, int64_t out_dim, int64_t in_dim, int32_t type, float* out);
/* Many rows against BF16/F16 weights on AVX2: panels widened once, six rows an outer product (widened_gemm.c). */
int pagedserve_widened_gemm(const float* x, int64_t rows, int64_t in_dim, const uint8_t* w, int64_t out_dim,
                            int32_t type, float* y);

/* --- the fused decode step (decode_step.c); worker/model/fused_decode.py mirrors these structs --------- */
#define PS_MAX_SEGMENTS 3

typedef void (*SgemmFn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                        const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                        const float* beta, float* c, const int* ldc);
typedef struct {
    const uint8_t* w; /* `rows` rows of in_dim values as blocks of ggml type `type` (0: fp32 values) */
    int64_t rows;
    int32_t type, pad;
} PsSegment;

typedef struct {
    /* consecutive row ranges, each in its own type: a stack of q, k and v (or gate and up) may mix them, as
       a Q4_K_M file's Q4_K queries beside its Q6_K values do; unused segments have 0 rows */
    PsSegment seg[PS_MAX_SEGMENTS]; /* a packed segment (PACKED_Q4/Q8/Q4K/Q6K) holds whole groups of 16 rows */
    int64_t out_dim, in_dim;
    const float* dense; /* the same matrix as plain fp32 rows [out_dim, in_dim], or NULL */
} PsMatrix;

/* A Mamba2 mixer (worker/model/mamba2.py): in_proj gives each token z [inner], x B C [conv_dim] and a raw step
   size a head [heads]; x B C through the causal conv and SiLU, the state-space step, then the gated norm. In the
   fused step in_proj is the layer's qkv matrix and out_proj its o_proj. */
typedef struct {
    const float *conv, *conv_bias; /* [conv_dim, kernel] (tap kernel-1 meets the new input), [conv_dim] */
    const float *dt_bias, *a, *d;  /* [heads]: a = -exp(A_log) */
    const float* norm;             /* [inner]: the gated norm's weight (unread with norm_kind 0) */
    float *conv_states, *ssm_states; /* the state pool's layer: [slots, kernel-1, conv_dim], [slots, heads, head_dim,
                                        d_state], advanced in place */
    int32_t heads, head_dim, groups, d_state, kernel;
    int32_t norm_kind; /* 0: y times SiLU(z) alone; 1: that, RMS-normed by groups (Granite); 2: normed, then gated */
    float dt_min, eps;
} PsMamba;

/* A Gated DeltaNet layer (worker/model/delta_net.py): in_proj gives each token x = q k v [conv_dim], the output
   gate z [v_heads * dv], b and a [v_heads] each; x through the causal conv (no bias) and SiLU, each value head's
   decay g = a_neg softplus(a + dt_bias) and beta = sigmoid(b) beta_scale, the delta rule, the gated norm. */
typedef struct {
    const float *conv, *dt_bias, *a_neg, *norm; /* [conv_dim, kernel]; [v_heads] each (a_neg = -exp(A_log)); [dv] */
    float *conv_states, *states;                /* the state pool's layer: [slots, kernel-1, conv_dim], [slots,
                                                   v_heads, dk, dv] fp32, advanced in place */
    int32_t k_heads, v_heads, dk, dv, kernel, tiled; /* tiled: value head h reads key head h % k_heads */
    float eps, beta_scale;
} PsDelta;

/* An LFM gated short-conv block (worker/model/short_conv.py): in_proj gives each token B, C and x [channels
   each]; B x through the depthwise causal conv (no bias, no activation), times C. In the fused step in_proj is the
   layer's qkv matrix and out_proj its o_proj. */
typedef struct {
    const float* conv;  /* [channels, kernel] (tap kernel-1 meets the new input) */
    float* conv_states; /* the state pool's layer: [slots, kernel-1, channels], advanced in place */
    int32_t channels, kernel;
} PsConv;

/* A mixture-of-experts MLP (worker/model/moe.py) as moe_experts.c routes and runs it: the router's logits
   (fp32 [experts, hidden]), softmax or sigmoid scores, the top_k by score (plus the correction, where there is
   one) within the best topk_groups of `groups` groups, their scores as weights, renormalized (sum + norm_eps) and
   scaled; each chosen expert's gate_up (or up alone) and down on its blocks. */
typedef struct {
    const float* router;          /* [experts, hidden] fp32 */
    const float* correction;      /* [experts]: added to sigmoid scores to choose by, or NULL */
    const float* router_bias;     /* [experts]: added to the router's logits (gpt-oss), or NULL */
    const int64_t *gate_up, *down; /* [experts]: the address of each expert's blocks (gate rows, then up) */
    const float *gate_up_bias, *down_bias; /* [experts, 2 inter], [experts, hidden] (gpt-oss), or NULL */
    int32_t gate_up_type, down_type, experts, top_k, inter;
    int32_t sigmoid;   /* 0: a softmax over every expert; 1: each expert's sigmoid */
    int32_t normalize; /* the chosen weights divided by their sum (+ norm_eps) */
    int32_t relu2;     /* 1: up rows alone, relu² (Nemotron-H's ungated experts), else gate and up rows */
    int32_t groups, topk_groups; /* the experts in `groups` equal groups, chosen within the topk_groups whose two
                                    best scores sum highest (1, 1: every expert) */
    int32_t pad;
    float norm_eps, scale; /* scale: every chosen weight times it */
    float limit, alpha;    /* limit 0: SiLU-mul; else gpt-oss's clamped SwiGLU */
} PsExperts;

typedef struct PsLayer {
    PsMatrix qkv, o_proj, gate_up, down;
    const float *input_norm, *post_norm; /* NULL: the residual stream goes in unnormed (OLMo 3) */
    const float* qkv_bias;        /* [q + 2 kv] or NULL */
    const float *q_norm, *k_norm; /* [head_dim] each, or NULL (Qwen3's per-head RMSNorm) */
    void *k_cache, *v_cache;      /* [num_blocks, block_size, n_kv_heads, head_dim], fp32 or bf16 (kv_bf16) */
    int32_t rope;                 /* 0: a layer without positions (SmolLM3's NoPE layers) */
    int32_t window;               /* > 0: a sliding-window layer, each token sees its last `window` keys */
    const PsMamba* mamba;         /* a Mamba2 layer (qkv is its in_proj, o_proj its out_proj), or NULL */
    const PsDelta* delta;         /* a Gated DeltaNet layer (the same places), or NULL */
    int32_t attn_gate; /* qkv ends in gates, attention's output times their sigmoid: 1 one a query value, 2 one a
                          query head (LFM3's) */
    int32_t qk_whole;  /* 1: q_norm [q] and k_norm [kv] norm each token's whole projection (OLMo 3, MiniMax-M2) */
    /* Gemma's norms of attention's and the MLP's outputs before each residual add, or NULL */
    const float *attn_out_norm, *mlp_out_norm;
    const float *cos, *sin; /* the layer's own RoPE tables (Gemma 3's sliding layers), or NULL: the model's */
    const PsConv* conv;     /* a short-conv layer (qkv its in_proj, o_proj its out_proj), or NULL */
    /* Falcon-H1's Mamba2 beside attention: a layer of the mixer alone (its in_proj and out_proj, its
       PsMamba) on the same normed input, its output added to attention's; or NULL */
    const struct PsLayer* beside;
    /* a mixture-of-experts MLP, or NULL; gate_up and down then hold its shared expert (or no rows), whose output
       is added, times sigmoid(shared_gate . x) where shared_gate is not NULL (Qwen's) */
    const PsExperts* experts;
    const float* shared_gate;
    const float* sinks;  /* [n_heads]: one more logit a head in each softmax, its value none (gpt-oss), or NULL */
    const float* o_bias; /* [hidden]: added to o_proj's output (gpt-oss), or NULL */
} PsLayer;

typedef struct {
    int32_t num_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate, block_size;
    int32_t rotary_half; /* the cos/sin tables' width: head_dim / 2, less under a partial_rotary_factor */
    float eps, scale;
    const float *cos, *sin; /* [max_positions, rotary_half] */
    const float* final_norm;
    const PsLayer* layers;
    /* A BLAS sgemm (Fortran interface, 32-bit integers: the one the process already has, found by the
       caller) for steps of more than gemm_rows tokens on matrices with a dense copy; NULL: never. Each thread
       calls it on its own share of the output rows from inside the parallel region, where the library runs
       single-threaded, so a step keeps one parallel region whatever its size. */
    SgemmFn sgemm;
    int32_t gemm_rows;
    int32_t kv_bf16; /* the KV pool holds bf16 (kv_rows.h) */
    int32_t x8;      /* packed weights meet 8-bit activations (packed_blocks.h bits8), else 16-bit */
    float residual_scale; /* each block's output scaled before its residual add (Granite), else 1 */
    int32_t gelu;         /* the gated MLP's activation: 0 SiLU, 1 GELU-tanh (Gemma's GeGLU) */
    float softcap;        /* attention scores = softcap tanh(scores / softcap) (Gemma 2); 0: off */
} PsModel;

/* worker/model/fused_decode.py builds these with ctypes; the library reports their sizes
   (pagedserve_struct_sizes) and the binding refuses a mismatch. On LP64 they are: */
_Static_assert(sizeof(PsSegment) == 24, "PsSegment: pointer, int64 rows, int32 type and pad");
_Static_assert(sizeof(PsMatrix) == 3 * 24 + 24, "PsMatrix: segments, out_dim, in_dim, dense");
_Static_assert(sizeof(PsMamba) == 8 * sizeof(void*) + 32, "PsMamba's fields");
_Static_assert(sizeof(PsDelta) == 6 * sizeof(void*) + 32, "PsDelta's fields");
_Static_assert(sizeof(PsConv) == 2 * sizeof(void*) + 8, "PsConv's fields");
_Static_assert(sizeof(PsLayer) == 4 * sizeof(PsMatrix) + 19 * sizeof(void*) + 16, "PsLayer's fields");
_Static_assert(sizeof(PsExperts) == 7 * sizeof(void*) + 64, "PsExperts' fields");
_Static_assert(sizeof(PsModel) == 104, "PsModel's fields");

/* One LoRA adapter's update of one fused projection (worker/model/lora.py Projection): for each part q,
   y[:, o_lo:o_hi] += (x @ A[a_lo:a_hi]^T) @ B_q^T, where A stacks every changed part's rows and B_q is the
   part's own [o_hi - o_lo, a_hi - a_lo] (the scale folded in). a NULL: unchanged. */
typedef struct {
    const float* a;                   /* [a_rows, in_dim] */
    const float* b[PS_MAX_SEGMENTS];  /* each part's B, rows of a_hi - a_lo values */
    int32_t a_rows, out_lo, out_hi, n_parts;
    int32_t part[PS_MAX_SEGMENTS][4]; /* each part's rows of A (a_lo, a_hi) and of the output (o_lo, o_hi) */
} PsLoraProj;

typedef struct {
    const PsLoraProj* proj;     /* [n_adapters][num_layers][4]: qkv, o_proj, gate_up, down */
    const int32_t* row_adapter; /* [rows]: each token's adapter, -1 for the base model */
    int32_t n_adapters, pad;
} PsLora;

_Static_assert(sizeof(PsLoraProj) == (1 + PS_MAX_SEGMENTS) * sizeof(void*) + 16 + PS_MAX_SEGMENTS * 16,
               "PsLoraProj's fields");
_Static_assert(sizeof(PsLora) == 2 * sizeof(void*) + 8, "PsLora's fields");

int64_t pagedserve_decode_step_scratch(const PsModel* m, int64_t rows);
/* lora: the step's adapters, or NULL where no row has one; state_slots: int64 [rows], each row's slot in the
   state pool (read where a layer is Mamba2), or NULL */
int pagedserve_decode_step(const PsModel* m, int64_t rows, float* x, const int64_t* positions,
                           const int64_t* slots, const int32_t* block_tables, int64_t table_stride,
                           const int32_t* seq_lens, const PsLora* lora, const int64_t* state_slots, float* scratch);

/* Mamba2's decode, one token a row: proj [rows, proj_stride] (in_proj's output: z, x B C, raw dt) -> out
   [rows, inner], gated-normed; each row's conv and SSD state advanced in its slot. scratch: rows x (conv_dim +
   inner) floats. The layer path's one call; the fused step runs the same three stages. -1: a shape it does
   not take. */
int pagedserve_mamba_decode(const PsMamba* mb, const float* proj, int64_t proj_stride, const int64_t* slots,
                            int64_t rows, float* out, float* scratch);
/* Gated DeltaNet's decode, one token a row, as pagedserve_mamba_decode: proj (x, z, b, a) -> out [rows, v_heads *
   dv], gated-normed. scratch: rows x (conv_dim + v_heads * dv) floats. */
int pagedserve_delta_decode(const PsDelta* dl, const float* proj, int64_t proj_stride, const int64_t* slots,
                            int64_t rows, float* out, float* scratch);

/* The fused step's stages as its profile counts them (kernels/cpu_native.py DECODE_STAGES names them in this
   order): each stage's work and the barrier closing it; the region's start counts in NORMS. */
enum { PS_NORMS, PS_ROUNDING, PS_QKV, PS_HEADS, PS_ATTENTION, PS_O_PROJ, PS_GATE_UP, PS_SILU, PS_DOWN,
       PS_LORA, PS_MAMBA, PS_EXPERTS, PS_DECODE_STAGES };
/* on: 1 times every fused step's stages from now, 0 stops. out (or null): int64 [PS_DECODE_STAGES + 1]
   receives the nanoseconds each stage took since the last call, then the steps counted; the counts then
   restart. Returns PS_DECODE_STAGES. */
int pagedserve_decode_profile(int32_t on, int64_t* out);

/* --- shared between translation units (the fused step runs attention through these) ---------------- */
void pagedserve_decode_item(const float* q_row, const void* k_cache, const void* v_cache, float* out_row,
                            const int32_t* table, int32_t first, int32_t len, int kh0, int kh1, int32_t n_heads,
                            int32_t n_kv_heads, int32_t head_dim, int32_t block_size, float scale, float softcap,
                            const float* sinks, int kv_bf16);
void pagedserve_decode_part(const float* q_row, const void* k_cache, const void* v_cache, const int32_t* table,
                            int32_t first, int32_t len, int kh0, int kh1, int32_t n_heads, int32_t n_kv_heads,
                            int32_t head_dim, int32_t block_size, float scale, float softcap, int kv_bf16, float* acc,
                            float* m, float* l);
int pagedserve_decode_splits(int32_t n, int32_t shortest, int32_t block_size);
void pagedserve_decode_range(int32_t first, int32_t len, int32_t block_size, int32_t splits, int32_t j,
                             int32_t* from, int32_t* to);
void pagedserve_decode_merge(const float* acc, const float* m, const float* l, int splits, int64_t stride,
                             int64_t mstride, int head_dim, const float* sink, float* out);
int pagedserve_decode_run_rows(int32_t n_heads, int32_t n_kv_heads);
void pagedserve_decode_run(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                           float* out, int64_t out_row_stride, int32_t n, const int32_t* table, int32_t len0,
                           int32_t kh, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                           float scale, float softcap, int32_t kv_bf16);
int pagedserve_decode_heads_per_item(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim);
/* Mamba2's decode for `rows` rows inside a parallel region (delta_rule.c): three `omp for` stages, channels of a
   row's conv (its conv state moved on), each head's step size and state-space step (the D skip added), each
   group's gated norm; proj, slots as pagedserve_mamba_decode's, conv_out [rows, conv_dim], y, out [rows, inner]. */
void pagedserve_mamba_stages(const PsMamba* mb, const float* proj, int64_t proj_stride, const int64_t* slots,
                             int64_t rows, float* conv_out, float* y, float* out);
int pagedserve_mamba_checks(const PsMamba* mb);
/* Gated DeltaNet's the same way: the conv, each value head's decay, beta and delta rule, its gated norm. */
void pagedserve_delta_stages(const PsDelta* dl, const float* proj, int64_t proj_stride, const int64_t* slots,
                             int64_t rows, float* conv_out, float* o, float* out);
int pagedserve_delta_checks(const PsDelta* dl);
#define PS_MAMBA_CONV_CHUNK 256 /* conv channels an item */
/* A mixture of experts inside a parallel region (moe_experts.c). route: each of `tokens` rows of x its top_k
   experts (ids) and weights, one `omp for` over the rows; scores: tokens x experts floats. stages: those experts'
   gate_up, activation and down for every row, out [tokens, hidden] overwritten, in a fixed eight `omp for` /
   `single` stages whatever the experts chosen; work: pagedserve_moe_work_bytes, 64-byte aligned. checks: 0 where
   the types and shapes are served. */
int pagedserve_moe_checks(const PsExperts* ex, int64_t hidden);
int64_t pagedserve_moe_work_bytes(const PsExperts* ex, int64_t hidden, int64_t tokens);
void pagedserve_moe_route(const PsExperts* ex, int64_t hidden, const float* x, int64_t tokens, int64_t* ids,
                          float* weights, float* scores);
void pagedserve_moe_stages(const PsExperts* ex, int64_t hidden, const float* x, int64_t tokens, const int64_t* ids,
                           const float* weights, int32_t bits8, float* out, void* work);
void pagedserve_prefill_rows(const float* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                             float* out, int64_t start, int32_t q_len, int32_t seq_len, const int32_t* table,
                             int32_t kh, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                             float scale, int32_t window, float softcap, const float* sinks, int32_t kv_bf16);

#endif
