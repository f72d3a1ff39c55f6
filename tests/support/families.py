"""Tiny instances of the late-2026 families, as config overrides of a transformers family (every
layer kind it mixes): the ones that keep a recurrent state, and the attention families; served in
tests/models/test_recurrent_families.py and test_attention_families.py, and as GGUFs in
test_gguf_families.py.
"""

from __future__ import annotations

LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
RECURRENT = {
    # Gated DeltaNet 3 : 1 gated attention, its projections fused per key head; MoE beside a
    # sigmoid-gated shared expert; partial RoPE 0.25
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **LINEAR,
    ),
    # gated short-conv blocks (a conv state only) beside sliding and full attention: proportional
    # partial RoPE on the full layers, per-head q/k norm and output gate, norms before and after
    "lfm3": dict(
        num_hidden_layers=5,
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
        sliding_window=8,
        conv_L_cache=3,
        # low bases: the still half of the full layers' frequencies would turn fast
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 100.0,
                "partial_rotary_factor": 0.5,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # LFM2: the short convs beside full attention alone, one RoPE, no gate, no norms after the
    # blocks; its MLP sized by block_auto_adjust_ff_dim (2/3 of 96, rounded up to 32: 64)
    "lfm2": dict(
        num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=3,
        intermediate_size=96,
        block_multiple_of=32,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # LFM2-MoE: LFM2's blocks, a dense first layer, then experts chosen by sigmoid score plus a
    # bias, renormalized (an epsilon in the sum) and scaled
    "lfm2_moe": dict(
        num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_dense_layers=1,
        routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Mamba2 mixers (conv and SSD state) and NoPE attention, every layer's MLP experts beside an
    # ungated shared MLP; embeddings, residual branches, attention scores and logits scaled
    "granitemoehybrid": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_d_conv=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        shared_intermediate_size=48,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
    # one block a layer: Mamba2, NoPE attention, a relu² MLP, or relu² experts chosen by sigmoid
    # score plus a correction bias within the best group, scaled, beside a shared relu² MLP
    "nemotron_h": dict(
        layers_block_type=[
            "linear_attention",
            "moe",
            "full_attention",
            "mlp",
            "linear_attention",
            "moe",
        ],
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        intermediate_size=48,
        moe_shared_expert_intermediate_size=48,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
    # Mamba2 and attention side by side in every layer, their outputs summed; its gated norm
    # (norm, then gate) and µP multipliers on every projection, the embeddings and the logits
    "falcon_h1": dict(
        num_hidden_layers=3,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_ssm=128,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_rms_norm=True,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.7,
        attention_in_multiplier=0.8,
        attention_out_multiplier=1.2,
        key_multiplier=0.9,
        ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3],
        mlp_multipliers=[1.1, 0.9],
    ),
    # Gated DeltaNet (beta to 2: negative eigenvalues; q, k and v convs apart, an output gate of
    # its own) 3 : 1 OLMo 3 attention (whole-projection q/k norm, norms after its blocks).
    # transformers saves its convs split in three equal parts: key and value widths kept equal
    "olmo_hybrid": dict(
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        pad_token_id=0,
    ),
}


ATTENTION = {
    # q/k RMSNorm over the whole projection, norms after attention and MLP only, 3 sliding : 1 full
    # with a RoPE set each
    "olmo3": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # whole-projection q/k norm, partial RoPE, every MLP experts chosen by sigmoid score plus a
    # correction bias
    "minimax_m2": dict(
        num_hidden_layers=3,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        rotary_dim=8,
    ),
    # a head size per layer type (full layers' wider, their values their keys' projection, one KV
    # head), proportional RoPE on full layers, v-norm, per-layer token embeddings, the last two
    # layers reading earlier layers' K/V with twice-wide MLPs, experts beside every dense MLP,
    # soft-capped logits; its learned scalars given values (saved as ones) so reading them counts
    "gemma4_text": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=8,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=384,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    ),
}

# LFM2-1.2B's config.json as released: attention layers by full_attn_idxs, block_ff_dim sized by
# block_auto_adjust_ff_dim, tie_embedding, a top-level rope_theta, 128,000 tokens of context
LFM2_1B = dict(
    model_type="lfm2",
    vocab_size=65536,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    block_ff_dim=12288,
    block_auto_adjust_ff_dim=True,
    block_ffn_dim_multiplier=1.0,
    block_multiple_of=256,
    full_attn_idxs=[2, 5, 8, 10, 12, 14],
    conv_L_cache=3,
    norm_eps=1e-5,
    rope_theta=1000000.0,
    tie_embedding=True,
    max_position_embeddings=128000,
)

# LFM2-8B-A1B's config.json as released: two dense leading layers 7168 wide, then 32 experts 1792
# wide, four a token, chosen by sigmoid score plus a bias; six attention layers of 24
LFM2_8B_A1B = dict(
    model_type="lfm2_moe",
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=7168,
    moe_intermediate_size=1792,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_dense_layers=2,
    num_experts=32,
    num_experts_per_tok=4,
    use_expert_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    conv_L_cache=3,
    norm_eps=1e-5,
    rope_theta=1000000.0,
    tie_embedding=True,
    max_position_embeddings=128000,
)
