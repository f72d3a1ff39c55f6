"""Which layers of a family are which (sliding windows, RoPE, linear attention, short convs,
Mamba2, Nemotron-H's single blocks), and the ModelConfig fields each stateful family reads from its
config.json.
"""

from __future__ import annotations

from worker.model.families import (
    BLOCK_TYPES,
    DELTA_NET_TYPES,
    GEMMA_TYPES,
    MAMBA_TYPES,
    PARALLEL_MAMBA_TYPES,
    POST_NORM_TYPES,
    SHARED_EXPERT_TYPES,
    SHORT_CONV_TYPES,
    SINK_TYPES,
    UnsupportedModel,
    block_kinds,
)


def layer_windows(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's window (0 = full); () when none slides."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    window = int(window)
    model_type = cfg.get("model_type", "llama")
    if model_type in ("mistral", "mixtral", "phi3"):  # their attention slides on every layer
        return (window,) * num_layers
    # layer_types; by default Gemma 3 slides five layers of six, Gemma 2 every other
    if model_type in (*GEMMA_TYPES, *SINK_TYPES, *POST_NORM_TYPES, *SHORT_CONV_TYPES):
        # gpt-oss slides every other layer, as Gemma 2; OLMo 3 where layer_types says
        pattern = int(cfg.get("sliding_window_pattern", 6)) if model_type == "gemma3_text" else 2
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
        sliding = [t == "sliding_attention" for t in types[:num_layers]]
        return tuple(window if s else 0 for s in sliding) if any(sliding) else ()
    if model_type not in ("qwen2", "qwen3", "qwen3_moe", "smollm3") or not cfg.get(
        "use_sliding_window"
    ):
        # Llama's attention has no window, the others' only with use_sliding_window: as transformers
        return ()
    types = cfg.get("layer_types")
    if types:
        if len(types) < num_layers:
            raise UnsupportedModel(
                "layer_types", types, f"needs one entry for each of the {num_layers} layers"
            )
        sliding = [t == "sliding_attention" for t in types[:num_layers]]
    elif model_type == "smollm3":  # its NoPE layers slide
        sliding = [not uses for uses in rope_layers(cfg, num_layers)]
    else:
        first = int(cfg.get("max_window_layers", 28))
        sliding = [i >= first for i in range(num_layers)]
    return tuple(window if s else 0 for s in sliding) if any(sliding) else ()


def linear_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """Layers that are Gated DeltaNet (linear attention) in a hybrid; () when none is."""
    if cfg.get("model_type") not in DELTA_NET_TYPES:
        return ()
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear"
        for i in range(num_layers)
    ]
    if len(types) < num_layers:
        raise UnsupportedModel(
            "layer_types", types, f"needs one entry for each of the {num_layers} layers"
        )
    return tuple(t.startswith("linear") for t in types[:num_layers])


def rope_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """Layers that apply RoPE: all but SmolLM3's NoPE layers, and none in Granite 4 unless its
    position_embedding_type says rope.
    """
    if cfg.get("model_type") == "granitemoehybrid":
        return (cfg.get("position_embedding_type") == "rope",) * num_layers
    if cfg.get("model_type") == "nemotron_h":
        return (False,) * num_layers
    if cfg.get("model_type") == "olmo_hybrid":  # NoPE where it gives no rope_parameters
        return (cfg.get("rope_parameters") is not None,) * num_layers
    if cfg.get("model_type") != "smollm3":
        return (True,) * num_layers
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise UnsupportedModel(
            "no_rope_layers", flags, f"needs one entry for each of the {num_layers} layers"
        )
    return tuple(bool(f) for f in flags[:num_layers])


def hybrid_fields(cfg: dict, num_layers: int) -> dict:
    """A hybrid's ModelConfig fields (Qwen3.5's names); {} for other families. OLMo-Hybrid: no
    output gate on its attention, which norms after its blocks (its Gated DeltaNet layers before),
    a delta rule whose beta reaches 2 (negative eigenvalues), a gated norm of eps 1e-5.
    """
    if cfg.get("model_type") not in DELTA_NET_TYPES:
        return {}
    olmo = cfg.get("model_type") == "olmo_hybrid"
    linear = linear_layers(cfg, num_layers)
    extra = dict(
        post_norm_layers=tuple(not x for x in linear),
        linear_beta_scale=2.0 if cfg.get("linear_allow_neg_eigval") else 1.0,
        linear_norm_eps=1e-5,
    )
    return dict(
        **(extra if olmo else {}),
        linear_layers=linear_layers(cfg, num_layers),
        linear_k_heads=int(cfg["linear_num_key_heads"]),
        linear_v_heads=int(cfg["linear_num_value_heads"]),
        linear_k_dim=int(cfg["linear_key_head_dim"]),
        linear_v_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_tiled_values=cfg.get("linear_value_head_order", "grouped") == "tiled",
        attn_output_gate=not olmo,
    )


def short_conv_fields(cfg: dict, num_layers: int) -> dict:
    """An LFM's ModelConfig fields: its conv layers, their width, its per-head output gate."""
    if cfg.get("model_type") not in SHORT_CONV_TYPES:
        return {}
    types = cfg.get("layer_types") or []
    if len(types) < num_layers:
        raise UnsupportedModel(
            "layer_types", types, f"needs one entry for each of the {num_layers} layers"
        )
    return dict(
        conv_layers=tuple(t == "conv" for t in types[:num_layers]),
        short_conv_kernel=int(cfg.get("conv_L_cache", 3)),
        attn_head_gate=bool(cfg.get("use_attention_gate", True)),
    )


def dense_width(cfg: dict, num_layers: int) -> int:
    """The dense MLP's intermediate size: the shared expert's, beside experts."""
    if cfg.get("model_type") not in SHARED_EXPERT_TYPES:
        return int(cfg["intermediate_size"])
    names = (
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",
    )
    shared = next((int(cfg[n]) for n in names if cfg.get(n)), 0)
    if cfg.get("model_type") in BLOCK_TYPES and "moe" not in block_kinds(cfg, num_layers):
        return int(cfg["intermediate_size"])  # no experts: its MLP layers' own width
    return shared


def mamba_fields(cfg: dict, num_layers: int) -> dict:
    """Granite 4's or Nemotron-H's Mamba2 layers and their shapes, Granite's multipliers,
    Nemotron-H's single-block layers and routing; {} for other families.
    """
    if cfg.get("model_type") not in MAMBA_TYPES:
        return {}
    if cfg.get("model_type") in BLOCK_TYPES:
        kinds = block_kinds(cfg, num_layers)
        return dict(
            mamba_layers=tuple(k == "mamba" for k in kinds),
            ffn_only_layers=tuple(k in ("mlp", "moe") for k in kinds),
            mixer_only_layers=tuple(k in ("mamba", "attention") for k in kinds),
            mamba_heads=int(cfg["mamba_num_heads"]),
            mamba_head_dim=int(cfg["mamba_head_dim"]),
            mamba_groups=int(cfg.get("n_groups", 1)),
            mamba_d_state=int(cfg["ssm_state_size"]),
            mamba_conv_kernel=int(cfg.get("conv_kernel", 4)),
            mamba_dt_min=float(cfg.get("time_step_min") or 0.0),
            gated_mlp=False,
            router_groups=int(cfg.get("n_group") or 1),
            router_topk_groups=int(cfg.get("topk_group") or 1),
            routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
        )
    parallel = cfg.get("model_type") in PARALLEL_MAMBA_TYPES
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    types = ["mamba"] * num_layers if parallel else types
    heads, head_dim = int(cfg["mamba_n_heads"]), cfg.get("mamba_d_head")
    if head_dim in (None, "auto"):
        head_dim = int(cfg["hidden_size"]) * int(cfg.get("mamba_expand", 2)) // heads
    limit = cfg.get("time_step_limit") or (0.0, None)
    return dict(
        mamba_layers=tuple(t in ("mamba", "linear_attention") for t in types[:num_layers]),
        mamba_heads=heads,
        mamba_head_dim=int(head_dim),
        mamba_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_d_state=int(cfg["mamba_d_state"]),
        mamba_conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        mamba_dt_min=float(limit[0] or 0.0),
        residual_scale=float(cfg.get("residual_multiplier") or 1.0),
        logit_scale=float(cfg.get("lm_head_multiplier") or 1.0)
        / float(cfg.get("logits_scaling") or 1.0),
        parallel_mamba=parallel,
        mamba_norm=mamba_norm_kind(cfg, parallel),
        weight_scales=falcon_scales(cfg, heads * int(head_dim), heads) if parallel else {},
    )


def mamba_norm_kind(cfg: dict, parallel: bool) -> str:
    """Granite's and Nemotron-H's Mamba2 gate then norm by groups; Falcon-H1's, as its config
    says: the gate alone, or norm then gate."""
    if not parallel:
        return "gated"
    if not cfg.get("mamba_rms_norm"):
        return "none"
    return "before_gate" if cfg.get("mamba_norm_before_gate", True) else "gated"


def falcon_scales(cfg: dict, inner: int, heads: int) -> dict:
    """Falcon-H1's µP multipliers folded into the weights they scale: tensor name's end -> one
    scale, or (rows, scale) sections down its rows (in_proj's z, x, B, C, dt).
    """
    attn_in, ssm_in = float(cfg.get("attention_in_multiplier", 1)), float(cfg["ssm_in_multiplier"])
    gate, down = (float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    states = int(cfg.get("mamba_n_groups", 1)) * int(cfg["mamba_d_state"])
    z, x, b, c, dt = (float(m) * ssm_in for m in cfg.get("ssm_multipliers") or [1.0] * 5)
    return {
        "mamba.in_proj.weight": ((inner, z), (inner, x), (states, b), (states, c), (heads, dt)),
        "mamba.out_proj.weight": float(cfg.get("ssm_out_multiplier", 1)),
        "self_attn.q_proj.weight": attn_in,
        "self_attn.k_proj.weight": attn_in * float(cfg.get("key_multiplier", 1)),
        "self_attn.v_proj.weight": attn_in,
        "self_attn.o_proj.weight": float(cfg.get("attention_out_multiplier", 1)),
        "feed_forward.gate_proj.weight": gate,
        "feed_forward.down_proj.weight": down,
    }
