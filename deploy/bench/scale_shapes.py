"""The model shapes `make bench-cpu-scale` (deploy/bench/cpu_scale.py) makes at random weights,
as the released models' config.json give them, and the vocabularies each is made with.
"""

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B, as their config.json give them
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
# Qwen3.5-4B and -0.8B (`qwen3_5_text`), as their config.json give them; these, Granite's and
# Gemma's are made by transformers' own model of them (cpu_scale.named_folder)
NAMED = {
    "qwen35-4b": dict(
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_value_heads=32,
    ),
    "qwen35-0.8b": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
    ),
}
for _shape in NAMED.values():  # the Qwen3.5 ones (Granite's is added below)
    _shape.update(
        head_dim=256,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        tie_word_embeddings=True,
    )
# Granite 4's hybrid at granite-4.0-h-1b's dims (attention every tenth layer, NoPE; dense MLP)
NAMED["granite4-h-1b"] = dict(
    model_type="granitemoehybrid",
    hidden_size=1536,
    num_hidden_layers=40,
    num_attention_heads=12,
    num_key_value_heads=4,
    layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)],
    mamba_n_heads=48,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    intermediate_size=4096,
    shared_intermediate_size=4096,
    num_local_experts=0,
    num_experts_per_tok=0,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0078125,
    logits_scaling=6.0,
    tie_word_embeddings=True,
)
# Gemma-3-1B (`gemma3_text`): five sliding layers (512 keys, RoPE of their own) to one global,
# GeGLU, norms around both blocks, head_dim 256, one KV head, a 262,144-token vocabulary
NAMED["gemma3-1b"] = dict(
    model_type="gemma3_text",
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    sliding_window_pattern=6,
    max_position_embeddings=32768,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    tie_word_embeddings=True,
)
# LFM2-1.2B (`lfm2`): ten gated short-conv layers (3 taps) and six attention layers, block_ff_dim
# 12,288 sized to an 8,192-wide MLP, a 65,536-token vocabulary
NAMED["lfm2-1.2b"] = dict(
    model_type="lfm2",
    hidden_size=2048,
    intermediate_size=12288,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    conv_L_cache=3,
    norm_eps=1e-5,
    max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)
# Nemotron-H-4B (`nemotron_h`): 52 blocks, each Mamba2 (112 heads of 64, 8 groups, a 128-wide
# state), an ungated relu² MLP, or (four) attention; its pattern as the released config writes it
NAMED["nemotron-h-4b"] = dict(
    model_type="nemotron_h",
    hidden_size=3072,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    mamba_num_heads=112,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
# LFM2-8B-A1B (`lfm2_moe`): LFM2's 18 short-conv and 6 attention layers, two dense MLPs 7,168 wide,
# then 32 experts 1,792 wide, four a token, chosen by sigmoid score plus a bias
NAMED["lfm2-8b-a1b"] = dict(
    model_type="lfm2_moe",
    hidden_size=2048,
    intermediate_size=7168,
    moe_intermediate_size=1792,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_dense_layers=2,
    num_experts=32,
    num_experts_per_tok=4,
    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    conv_L_cache=3,
    norm_eps=1e-5,
    max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)
# OLMo-3-7B (`olmo3`): 32 layers, full multi-head attention (32 KV heads), q/k normed over the
# whole projection, norms after each block only, three 4,096-key sliding layers to one full
NAMED["olmo3-7b"] = dict(
    model_type="olmo3",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    sliding_window=4096,
    layer_types=["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(32)],
    max_position_embeddings=65536,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False,
)
SHAPES.update(NAMED)
# gpt-oss-20b (`gpt_oss`) as its config.json gives it; its experts MXFP4 as it ships them
GPT_OSS = {
    "gpt-oss-20b": dict(
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,  # YaRN x32 over 4,096: transformers' default
        tie_word_embeddings=False,
    )
}
SHAPES.update(GPT_OSS)
VOCABS = (49152, 128256)  # SmolLM2's own, Llama-3's
