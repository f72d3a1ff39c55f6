"""Which layers of a family are which (sliding windows, RoPE, linear attention, short convs,
Mamba2, Nemotron-H's single blocks), and the ModelConfig fields each stateful family reads from its
config.json.
"""

from __future__ import annotations

from worker.model.families import (
    BLOCK_TYPES,
    DELTA_NET_TYPES,
    GEMMA4_TYPES,
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
    if model_type in (
        *GEMMA_TYPES,
        *GEMMA4_TYPES,
        *SINK_TYPES,
        *POST_NORM_TYPES,
        *SHORT_CONV_TYPES,
    ):
        # gpt-oss slides every other layer, as Gemma 2; OLMo 3 where layer_types says
        sixth = model_type in ("gemma3_text", *GEMMA4_TYPES)
        pattern = int(cfg.get("sliding_window_pattern", 6)) if sixth else 2
        sliding = [t == "sliding_attention" for t in layer_types(cfg, num_layers, pattern)]
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


def layer_types(cfg: dict, num_layers: int, pattern: int) -> list[str]:
    """The config's layer_types, or every pattern-th layer full; Gemma 4's last is always full."""
    types = list(cfg.get("layer_types") or [])[:num_layers] or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    if cfg.get("model_type") in GEMMA4_TYPES:
        types[-1] = "full_attention"
    return types


def gemma4_fields(cfg: dict, num_layers: int) -> dict:
    """Gemma 4's full layers' head size and KV heads, the layers that read another's K/V, MLP
    widths, per-layer token embeddings and experts beside the MLP, as transformers reads them.
    """
    if cfg.get("model_type") not in GEMMA4_TYPES:
        return {}
    types = layer_types(cfg, num_layers, int(cfg.get("sliding_window_pattern", 6)))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not overrides:  # as transformers builds it from these two
        override = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            override["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        overrides = dict.fromkeys(full, override)
    if sorted(overrides) != full or any(overrides[i] != overrides[full[0]] for i in full):
        raise UnsupportedModel(
            "per_layer_config", cfg.get("per_layer_config"), "one override for every full layer"
        )
    override = overrides[full[0]]
    if set(override) - {"head_dim", "num_key_value_heads"}:
        raise UnsupportedModel("per_layer_config", override, "overrides head_dim and KV heads only")
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first = num_layers - shared
    if shared and (first < 1 or set(types[first:]) - set(types[:first])):
        raise UnsupportedModel(
            "num_kv_shared_layers", shared, "needs an earlier layer of each type to read K/V from"
        )
    # a sharing layer reads the last earlier layer of its type that keeps its own
    sources = [
        i if i < first else max(j for j in range(first) if types[j] == types[i])
        for i in range(num_layers)
    ]
    inter = int(cfg["intermediate_size"])
    wide = 2 if cfg.get("use_double_wide_mlp") else 1
    per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
    return dict(
        global_head_dim=int(override.get("head_dim") or 0),
        global_kv_heads=int(override.get("num_key_value_heads") or 0),
        values_from_keys=bool(cfg.get("attention_k_eq_v")),
        kv_sources=tuple(sources) if shared else (),
        layer_widths=tuple(inter * (wide if i >= first else 1) for i in range(num_layers))
        if shared and wide > 1
        else (),
        per_layer_input_size=per_layer,
        per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or 0) if per_layer else 0,
    )


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
    routing = {}
    if cfg.get("model_type") == "lfm2_moe":  # transformers adds 1e-6 to the chosen weights' sum
        routing = dict(
            routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
            router_correction=bool(cfg.get("use_expert_bias", True)),
            router_norm_eps=1e-6,
        )
    return dict(
        conv_layers=tuple(t == "conv" for t in types[:num_layers]),
        short_conv_kernel=int(cfg.get("conv_L_cache", 3)),
        attn_head_gate=bool(cfg.get("use_attention_gate", True)),
        **routing,
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


def parameter_count(config) -> int:
    """Parameters the config implies: what loading takes, before allocating anything."""
    h = config.hidden_size

    def attn(i: int) -> int:
        hd, kv = config.head_dim_of(i), config.kv_heads_of(i) if config.writes_kv(i) else 0
        return h * hd * (2 * config.num_heads + 2 * kv)

    moe = config.num_experts * 3 * h * config.moe_intermediate_size + h * config.num_experts
    v_size = config.linear_v_heads * config.linear_v_dim
    # in_proj_qkv, z, a and b, the conv, out_proj
    linear = h * (config.conv_dim + v_size + 2 * config.linear_v_heads) + h * v_size
    linear += config.conv_dim * config.linear_conv_kernel
    gate = h * config.num_heads * config.head_dim if config.attn_output_gate else 0
    beside = config.shared_expert or config.moe_beside_mlp
    layers = sum(
        (linear if config.is_linear(i) else attn(i) + gate)
        + (
            moe + (3 * h * config.mlp_width(i) + h if beside else 0)
            if (config.moe_layers and config.moe_layers[i])
            else 3 * h * config.mlp_width(i)
        )
        for i in range(config.num_layers)
    )
    # per-layer token embeddings: their table, the projection into them, each layer's gate and
    # projection out
    p = config.per_layer_input_size * config.num_layers
    layers += p * (config.per_layer_vocab + 3 * h)
    return config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + layers
