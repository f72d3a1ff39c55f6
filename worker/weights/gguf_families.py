"""GGUFs of these families as llama.cpp's convert_hf_to_gguf.py writes them (ARCHS): each one's
config.json from its header, and its tensors under the names every family's checkpoint is read by
(worker/weights/checkpoint.py DEFAULT_LAYER_NAMES), the converter's changes undone.
"""

from __future__ import annotations

# each architecture's transformers family
ARCHS = {
    "olmo2": "olmo3",
    "minimax-m2": "minimax_m2",
    "granitehybrid": "granitemoehybrid",
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h",
    "falcon-h1": "falcon_h1",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "lfm2": "lfm2",
    "lfm2moe": "lfm2_moe",
}
GEMMA_ARCHS = ("gemma2", "gemma3")
# Gemma's four norms a layer (the converter stores each as 1 + w, q/k norms and the final one too)
GEMMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# experts stacked [experts, rows, cols], read one expert at a time (worker/weights/gguf.py)
EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
MAMBA = {
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_a": "mamba.A_log",  # as -exp(A_log)
    "ssm_d": "mamba.D",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_norm.weight": "mamba.norm.weight",  # by group
}
NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",  # Falcon-H1's, written without a suffix
    # OLMo's, on the attention and MLP outputs
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# LFM2's gated short convs (the conv squeezed to [channels, kernel])
SHORT_CONV = {f"shortconv.{n}.weight": f"conv.{n}.weight" for n in ("in_proj", "conv", "out_proj")}
TABLE = {**ATTENTION, **MLP, **EXPERTS, **MAMBA, **NORMS, **SHORT_CONV}


def layer_name(file, layer: int, suffix: str) -> str | None:
    """The Hugging Face name (under model.layers.N.) of a layer's tensor; None: not mapped."""
    if file.arch in GEMMA_ARCHS and suffix in GEMMA_NORMS:
        return GEMMA_NORMS[suffix]
    hf = TABLE.get(suffix)
    # Nemotron-H's one norm a layer is before its MLP where the layer is an MLP alone
    if suffix == "attn_norm.weight" and ARCHS[file.arch] == "nemotron_h" and _ffn_only(file, layer):
        hf = "post_attention_layernorm.weight"
    if suffix == "post_attention_norm.weight" and file.arch != "olmo2":
        return None
    return hf


def undo(name: str, t, arch: str):
    """A tensor as the family's checkpoint holds it, from the converter's form."""
    import torch

    if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
        return t - 1.0
    if name.endswith("mamba.A_log"):
        return torch.log(-t.reshape(-1))
    if name.endswith(("mamba.D", "mamba.norm.weight")):
        return t.reshape(-1)
    return t


def _kinds(file) -> list[str]:
    """Each block's kind, by the tensors it holds: mamba, conv, attention, moe or mlp."""
    known = getattr(file, "block_kinds", None)
    if known is not None:
        return known
    held_by: dict[str, set[str]] = {}
    for name in file.tensors:
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3:
            held_by.setdefault(parts[1], set()).add(parts[2])
    out = []
    for i in range(int(file.fields[f"{file.arch}.block_count"])):
        held = held_by.get(str(i), set())
        if "ssm_in.weight" in held:
            out.append("mamba")
        elif "shortconv.in_proj.weight" in held:
            out.append("conv")
        elif "attn_q.weight" in held:
            out.append("attention")
        else:
            out.append("moe" if "ffn_up_exps.weight" in held else "mlp")
    file.block_kinds = out  # read once a file
    return out


def _ffn_only(file, layer: int) -> bool:
    return _kinds(file)[layer] in ("moe", "mlp")


def _common(file) -> dict:
    f, a = file.fields, file.arch
    heads = int(f[f"{a}.attention.head_count"])
    hidden = int(f[f"{a}.embedding_length"])
    head_dim = int(f.get(f"{a}.attention.key_length") or hidden // heads)
    kinds = _kinds(file)
    keys = [f"blk.{i}.attn_k.weight" for i in range(len(kinds))]
    kv = next((_rows(file, k) // head_dim for k in keys if k in file.tensors), 1)
    ffn = f.get(f"{a}.feed_forward_length", 0)
    return {
        "model_type": ARCHS[a],
        "vocab_size": int(file.tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "intermediate_size": int(max(ffn) if isinstance(ffn, list) else ffn),
        "rms_norm_eps": _f32(f[f"{a}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(f.get(f"{a}.context_length", 4096)),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(f.get(f"{a}.rope.freq_base", 10000.0)),
        },
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }


def _mamba(file) -> dict:
    f, a = file.fields, file.arch
    heads = int(f[f"{a}.ssm.time_step_rank"])
    return {
        "heads": heads,
        "head_dim": int(f[f"{a}.ssm.inner_size"]) // heads,
        "state": int(f[f"{a}.ssm.state_size"]),
        "groups": int(f[f"{a}.ssm.group_count"]),
        "conv": int(f[f"{a}.ssm.conv_kernel"]),
    }


def config(file) -> dict:
    """The Hugging Face config.json of a file of these architectures, from its header."""
    f, a, cfg = file.fields, file.arch, _common(file)
    family = ARCHS[a]
    if family == "olmo3":
        pattern = f.get(f"{a}.attention.sliding_window_pattern")
        window = f.get(f"{a}.attention.sliding_window")
        layers = cfg["num_hidden_layers"]
        sliding = list(pattern) if window and isinstance(pattern, list) else [False] * layers
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        cfg["sliding_window"] = int(window or 0) or None
        full = cfg["rope_parameters"]
        local = dict(full, rope_theta=float(f.get(f"{a}.rope.freq_base_swa", full["rope_theta"])))
        cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    elif family == "minimax_m2":
        cfg.update(
            num_local_experts=int(f[f"{a}.expert_count"]),
            num_experts_per_tok=int(f[f"{a}.expert_used_count"]),
            intermediate_size=int(f[f"{a}.expert_feed_forward_length"]),
            rotary_dim=int(f[f"{a}.rope.dimension_count"]),
        )
        cfg["rope_parameters"]["partial_rotary_factor"] = cfg["rotary_dim"] / cfg["head_dim"]
    elif family == "granitemoehybrid":
        cfg.update(_granite(file))
    elif family == "nemotron_h":
        cfg.update(_nemotron(file))
    elif a in GEMMA_ARCHS:
        cfg.update(_gemma(file, cfg))
    elif family in ("lfm2", "lfm2_moe"):
        cfg.update(_lfm2(file))
    else:
        cfg.update(_falcon(file))
    return cfg


def _lfm2(file) -> dict:
    """LFM2's, and LFM2-MoE's experts after its dense leading layers (llama.cpp renormalizes their
    weights and requires the bias they are chosen by).
    """
    f, a = file.fields, file.arch
    kinds = _kinds(file)
    out = {
        "layer_types": ["conv" if k == "conv" else "full_attention" for k in kinds],
        "conv_L_cache": int(f[f"{a}.shortconv.l_cache"]),
        "block_auto_adjust_ff_dim": False,  # the header's width is the MLP's
    }
    if ARCHS[a] == "lfm2_moe":
        out.update(
            num_experts=int(f[f"{a}.expert_count"]),
            num_experts_per_tok=int(f[f"{a}.expert_used_count"]),
            moe_intermediate_size=int(f[f"{a}.expert_feed_forward_length"]),
            num_dense_layers=int(f.get(f"{a}.leading_dense_block_count", 0)),
            routed_scaling_factor=_f32(f.get(f"{a}.expert_weights_scale", 0.0)) or 1.0,
            norm_topk_prob=True,
            use_expert_bias=True,
        )
    return out


def _granite(file) -> dict:
    f, a, m = file.fields, file.arch, _mamba(file)
    experts = int(f.get(f"{a}.expert_count", 0))
    out = {
        "layer_types": ["mamba" if k == "mamba" else "attention" for k in _kinds(file)],
        "mamba_n_heads": m["heads"],
        "mamba_d_head": m["head_dim"],
        "mamba_d_state": m["state"],
        "mamba_n_groups": m["groups"],
        "mamba_d_conv": m["conv"],
        "embedding_multiplier": _f32(f.get(f"{a}.embedding_scale", 1.0)),
        "residual_multiplier": _f32(f.get(f"{a}.residual_scale", 1.0)),
        "attention_multiplier": _f32(f.get(f"{a}.attention.scale", 0.0)) or None,
        "logits_scaling": _f32(f.get(f"{a}.logit_scale", 1.0)),
        # llama.cpp rotates where rope_finetuned says so (NoPE otherwise)
        "position_embedding_type": "rope" if f.get(f"{a}.rope.scaling.finetuned") else None,
    }
    if experts:
        out.update(
            num_local_experts=experts,
            num_experts_per_tok=int(f[f"{a}.expert_used_count"]),
            shared_intermediate_size=int(f.get(f"{a}.expert_shared_feed_forward_length", 0)),
        )
    else:  # a dense model's MLP is its shared one
        out["shared_intermediate_size"] = _rows(file, "blk.0.ffn_up.weight")
    return out


def _gemma(file, cfg: dict) -> dict:
    """Gemma 2 and 3 as llama.cpp runs them: every 2nd (6th) layer global unless the header lists
    the sliding ones, the sliding layers' own RoPE base (Gemma 3), the score scale by size (the
    27B's hidden / heads, else head_dim), the soft caps.
    """
    f, a, layers = file.fields, file.arch, cfg["num_hidden_layers"]
    gemma2 = a == "gemma2"
    window = int(f.get(f"{a}.attention.sliding_window", 4096 if gemma2 else 0))
    pattern = f.get(f"{a}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    sliding = (
        [bool(p) for p in pattern]
        if isinstance(pattern, list)
        else [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    )
    largest = layers == (46 if gemma2 else 62)  # the 27B models
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if largest else cfg["head_dim"]
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "final_logit_softcapping": _f32(f.get(f"{a}.final_logit_softcapping", 0.0)) or None,
    }
    if gemma2:
        out["attn_logit_softcapping"] = _f32(f.get(f"{a}.attn_logit_softcapping", 0.0)) or None
        return out
    full = dict(cfg["rope_parameters"])
    if f.get(f"{a}.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=_f32(f[f"{a}.rope.scaling.factor"]))
    local = {"rope_type": "default", "rope_theta": float(f.get(f"{a}.rope.freq_base_swa", 1e4))}
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


def _f32(value) -> float:
    """A float the header stores as float32, as the shortest decimal that rounds to it (1e-05, not
    9.9999997e-06)."""
    return float(f"{float(value):.7g}")


def _rows(file, name: str) -> int:
    return int(file.tensors[name].shape[1])


def _nemotron(file) -> dict:
    f, a, m = file.fields, file.arch, _mamba(file)
    kinds = _kinds(file)
    # a dense MLP's width from its up projection's rows (the header's list gives the experts')
    dense = [_rows(file, f"blk.{i}.ffn_up.weight") for i, k in enumerate(kinds) if k == "mlp"]
    out = {
        "layers_block_type": kinds,
        "mamba_num_heads": m["heads"],
        "mamba_head_dim": m["head_dim"],
        "ssm_state_size": m["state"],
        "n_groups": m["groups"],
        "conv_kernel": m["conv"],
        "time_step_min": 0.001,  # not in the file: transformers' default
        "mlp_hidden_act": "relu2",
    }
    shared = int(f.get(f"{a}.expert_shared_feed_forward_length", 0))
    out["intermediate_size"] = int(max(dense or [0]) or shared)
    if "moe" in kinds:
        out.update(
            n_routed_experts=int(f[f"{a}.expert_count"]),
            num_experts_per_tok=int(f[f"{a}.expert_used_count"]),
            moe_intermediate_size=int(f[f"{a}.expert_feed_forward_length"]),
            moe_shared_expert_intermediate_size=shared,
            n_group=int(f.get(f"{a}.expert_group_count", 1)),
            topk_group=int(f.get(f"{a}.expert_group_used_count", 1)),
            routed_scaling_factor=_f32(f.get(f"{a}.expert_weights_scale", 1.0)),
            norm_topk_prob=bool(f.get(f"{a}.expert_weights_norm", True)),
        )
    return out


def _falcon(file) -> dict:
    """Falcon-H1: its µP multipliers are folded into the file's weights by the converter; its
    Mamba2 output gated, then normed by groups where the file has the norm (as llama.cpp runs it).
    """
    m = _mamba(file)
    return {
        "mamba_n_heads": m["heads"],
        "mamba_d_head": m["head_dim"],
        "mamba_d_ssm": m["heads"] * m["head_dim"],
        "mamba_d_state": m["state"],
        "mamba_n_groups": m["groups"],
        "mamba_d_conv": m["conv"],
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in file.tensors,
        "mamba_norm_before_gate": False,
        **dict.fromkeys(FALCON_SCALARS, 1.0),
        "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0],
    }


# Falcon-H1's multipliers, all folded into the file's weights
FALCON_SCALARS = tuple(
    f"{n}_multiplier"
    for n in "embedding lm_head attention_in attention_out key ssm_in ssm_out".split()
)


def gpt_oss_config(file) -> dict:
    """The Hugging Face config.json of a gpt-oss file, from its header (transformers' GGUF reader
    fails on its rope-scaling keys). YaRN as llama.cpp rotates, every other layer sliding from the
    first, its SwiGLU's limit and alpha as llama.cpp fixes them.
    """
    f, a = file.fields, file.arch
    layers = int(f[f"{a}.block_count"])
    rope = {"rope_type": "default", "rope_theta": float(f.get(f"{a}.rope.freq_base", 10000.0))}
    if f.get(f"{a}.rope.scaling.type") == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(f[f"{a}.rope.scaling.factor"]),
            beta_fast=float(f.get(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(f.get(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
            original_max_position_embeddings=int(f[f"{a}.rope.scaling.original_context_length"]),
        )
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": int(file.tensors["token_embd.weight"].shape[1]),
        "hidden_size": int(f[f"{a}.embedding_length"]),
        "num_hidden_layers": layers,
        "num_attention_heads": int(f[f"{a}.attention.head_count"]),
        "num_key_value_heads": int(f[f"{a}.attention.head_count_kv"]),
        "head_dim": int(f[f"{a}.attention.key_length"]),
        "intermediate_size": int(f[f"{a}.expert_feed_forward_length"]),
        "num_local_experts": int(f[f"{a}.expert_count"]),
        "num_experts_per_tok": int(f[f"{a}.expert_used_count"]),
        "rms_norm_eps": float(f[f"{a}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(f[f"{a}.context_length"]),
        "sliding_window": int(f[f"{a}.attention.sliding_window"]),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        "rope_parameters": rope,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
