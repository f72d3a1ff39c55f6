"""The model families a worker serves, config fields refused by name, and per-layer patterns."""

from __future__ import annotations

from worker.model.lfm import lfm2_config

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "gemma2",
    "gemma3_text",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gpt_oss",
    "olmo3",
    "minimax_m2",
    "lfm3",
    "lfm2",
    "lfm2_moe",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "olmo_hybrid",
    "gemma4_text",
)
# (1 + w) norms around attention and MLP, GeGLU, scaled embeddings
GEMMA_TYPES = ("gemma2", "gemma3_text")
# the mixture-of-experts families (router top-k over SwiGLU experts)
MOE_TYPES = (
    "qwen3_moe",
    "mixtral",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gpt_oss",
    "minimax_m2",
    "granitemoehybrid",
    "nemotron_h",
    "lfm2_moe",
)
# gpt-oss: attention sinks, biases on every projection and the router, a clamped SwiGLU
SINK_TYPES = ("gpt_oss",)
# and those whose experts sit beside one shared expert, gated per token
SHARED_EXPERT_TYPES = ("qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h")
# the gated MLP's activation: SiLU, or GELU-tanh where the family uses it
GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# dynamic (NTK) only changes the frequencies past max_position_embeddings, which is never served
# proportional (LFM3, Gemma 4): the first partial_rotary_factor of each head's frequencies, the
# rest still
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "proportional")
# Gemma 4: a head size per layer type, KV shared across the last layers, per-layer token
# embeddings, experts beside the dense MLP, plain-weight norms
GEMMA4_TYPES = ("gemma4_text",)
# families whose transformers attention rotates only the first partial_rotary_factor of each head
PARTIAL_ROTARY_TYPES = ("phi3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "minimax_m2")
# hybrids: Gated DeltaNet layers (a recurrent state per sequence) between gated attention layers
# (Qwen3-Next's projections fused per key head: worker/weights/checkpoint.py)
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# and every family with Gated DeltaNet layers: OLMo-Hybrid's beside OLMo 3's attention
DELTA_NET_TYPES = (*HYBRID_TYPES, "olmo_hybrid")


# families transformers reads that are not served, by the piece each lacks here
_MLA = "multi-head latent attention (MLA: keys and values cached as one low-rank latent)"
_MAMBA = "Mamba selective state-space layers"
NOT_SERVED = {
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "kimi_k2": _MLA,
    "longcat_flash": f"{_MLA} and zero-computation experts",
    "deepseek_v32": f"{_MLA} and a sparse top-k indexer (each query attends to the keys it picks)",
    "deepseek_v4": "hyper-connections (residual streams mixed by learned weights), compressed "
    "attention with a sparse top-k indexer, and hash-routed experts",
    "qwen4_exp": "a sparse top-k attention indexer, gated residuals, n-gram and per-layer "
    "embeddings",
    "glm5_next": "hyper-connections and a sparse top-k indexer beside linear attention",
    "kimi_linear": f"Kimi Delta Attention beside {_MLA}",
    "mamba": _MAMBA,
    "mamba2": _MAMBA,
    "falcon_mamba": _MAMBA,
    "jamba": _MAMBA,
    "bamba": _MAMBA,
    "zamba": _MAMBA,
    "zamba2": _MAMBA,
}


def architecture_refusal(cfg: dict) -> str | None:
    """What a config.json's architecture lacks to be served, in one line; None where it is served.
    Read before anything else, so a refusal names the architecture, not a symptom of it."""
    model_type = language_config(cfg).get("model_type", "llama")
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    if model_type in NOT_SERVED:
        lacks = NOT_SERVED[model_type]
        return f"{model_type} is not served: it needs {lacks}, which pagedserve does not implement"
    return f"{model_type} is not served (served: {', '.join(SUPPORTED_MODEL_TYPES)})"


# OLMo 3: norms after attention and MLP only
POST_NORM_TYPES = ("olmo3",)
# q/k RMSNorm over the whole projection, not head by head
WHOLE_QK_NORM_TYPES = ("olmo3", "minimax_m2", "olmo_hybrid")
# MiniMax-M2 (Nemotron-H, LFM2-MoE): experts chosen by sigmoid scores plus a correction bias,
# weighted by the scores
SIGMOID_ROUTER_TYPES = ("minimax_m2", "nemotron_h", "lfm2_moe")
# LFM: gated short-conv blocks beside (sliding and full) attention; LFM2's read as LFM3's fields
SHORT_CONV_TYPES = ("lfm3", "lfm2", "lfm2_moe")
# every MLP a mixture of intermediate_size-wide experts, the chosen weights renormalized
ALL_MOE_TYPES = ("mixtral", "minimax_m2", "granitemoehybrid")
# Mamba2 mixers (a conv and an SSD state per sequence) beside attention layers
MAMBA_TYPES = ("granitemoehybrid", "nemotron_h", "falcon_h1")
# Falcon-H1: Mamba2 and attention side by side in every layer, their outputs summed
PARALLEL_MAMBA_TYPES = ("falcon_h1",)
# Nemotron-H: one block a layer (Mamba2, attention, a relu² MLP or experts alone), its kinds
# named in layers_block_type or, in released configs, hybrid_override_pattern's letters
BLOCK_TYPES = ("nemotron_h",)
PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}
# Granite: embeddings, residual branches, attention scores and logits scaled by the config
MULTIPLIER_TYPES = ("granitemoehybrid", "falcon_h1")


# multimodal folders served as text: their language model's config, under its own model_type
TEXT_OF_MULTIMODAL = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "gemma4": "gemma4_text",
}


def language_config(cfg: dict) -> dict:
    """The config a multimodal folder's language model has (its text_config), else cfg itself."""
    kind = TEXT_OF_MULTIMODAL.get(cfg.get("model_type"))
    if cfg.get("model_type") in ("lfm2", "lfm2_moe"):
        return lfm2_config(cfg)
    if cfg.get("model_type") in BLOCK_TYPES and "num_hidden_layers" not in cfg:
        # Nemotron-H's count is its list of blocks' (or pattern's) length
        blocks = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern") or ()
        return {**cfg, "num_hidden_layers": len(blocks)}
    if kind is None or not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = {**cfg["text_config"], "model_type": kind}
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return text


class UnsupportedModel(ValueError):
    """A config field changes the computation in a way this model code does not implement."""

    def __init__(self, field_name: str, value, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field_name, self.value = field_name, value


def check_supported(cfg: dict) -> None:
    # one function: one check a config field, read as a list
    """Refuse, naming it, every config field that would change the math and is not implemented."""
    model_type = cfg.get("model_type", "llama")
    refusal = architecture_refusal(cfg)
    if refusal:
        raise UnsupportedModel("model_type", model_type, refusal)
    act_field = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"
    act = cfg.get(act_field, "silu")
    if model_type in BLOCK_TYPES:  # its MLPs and experts: up, relu², down
        act_field, act = "mlp_hidden_act", cfg.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise UnsupportedModel(act_field, act, "Nemotron-H's MLPs are implemented with relu²")
        kinds = set(block_kinds(cfg, int(cfg.get("num_hidden_layers") or 0)))
        shared = cfg.get("moe_shared_expert_intermediate_size")
        if {"mlp", "moe"} <= kinds and shared != cfg.get("intermediate_size"):
            raise UnsupportedModel(
                "moe_shared_expert_intermediate_size",
                shared,
                "MLP layers beside a shared expert of another width are not implemented",
            )
        if cfg.get("moe_latent_size"):
            raise UnsupportedModel(
                "moe_latent_size",
                cfg["moe_latent_size"],
                "latent expert projections are not implemented",
            )
    elif act not in GATED_ACTIVATIONS or (
        GATED_ACTIVATIONS[act] == "gelu_tanh" and model_type not in (*GEMMA_TYPES, *GEMMA4_TYPES)
    ):
        raise UnsupportedModel(
            act_field,
            act,
            "the gated MLP is implemented with SiLU, and with GELU-tanh for Gemma 2, 3 and 4",
        )
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(
            "use_bidirectional_attention", True, "bidirectional attention is not implemented"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(
            "mlp_bias", cfg["mlp_bias"], "MLP projections with biases are not implemented"
        )
    # Qwen2's q/k/v biases are, gpt-oss's o_proj bias too; others' o_proj bias is not
    if cfg.get("attention_bias") and model_type not in ("qwen2", *SINK_TYPES):
        raise UnsupportedModel(
            "attention_bias",
            cfg["attention_bias"],
            f"{model_type} puts a bias on o_proj too, which is not implemented",
        )
    for rope in rope_sets(cfg):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise UnsupportedModel(
                "rope_scaling.rope_type", kind, f"implemented: {', '.join(ROPE_TYPES)}"
            )
    rope = rope_sets(cfg)[0]
    proportional = (rope.get("rope_type") or rope.get("type")) == "proportional"
    for name, value in (
        ("partial_rotary_factor", None if proportional else rope.get("partial_rotary_factor")),
        ("partial_rotary_factor", cfg.get("partial_rotary_factor")),
    ):
        if value is not None and float(value) != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:
            raise UnsupportedModel(
                name,
                value,
                "partial rotary embeddings are implemented for "
                f"{', '.join(PARTIAL_ROTARY_TYPES)} only (as transformers "
                "does)",
            )
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping"):
        allowed = {
            "attn_logit_softcapping": ("gemma2",),
            "final_logit_softcapping": (*GEMMA_TYPES, *GEMMA4_TYPES),
        }.get(name, ())
        if cfg.get(name) is not None and model_type not in allowed:
            raise UnsupportedModel(
                name,
                cfg[name],
                f"{'attention-' if name.startswith('attn') else ''}logit "
                "soft-capping is implemented for "
                f"{', '.join(allowed) or 'no'} models as transformers "
                "runs them",
            )
    for name in (
        "embedding_multiplier",
        "scale_emb",
        "logits_scaling",
        "residual_multiplier",
        "attention_multiplier",
    ):
        if cfg.get(name) not in (None, 1, 1.0) and model_type not in MULTIPLIER_TYPES:
            raise UnsupportedModel(
                name, cfg[name], "scaled embeddings, residuals or logits are not implemented"
            )
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(name) and model_type not in (*MOE_TYPES, *GEMMA4_TYPES):
            raise UnsupportedModel(
                name,
                cfg[name],
                f"mixture-of-experts layers are implemented for {', '.join(MOE_TYPES)}",
            )
    if model_type in MOE_TYPES:
        experts, top_k = num_experts(cfg), int(cfg.get("num_experts_per_tok") or 0)
        if experts and not 0 < top_k <= experts:
            raise UnsupportedModel(
                "num_experts_per_tok", top_k, f"needs 1 to num_experts ({experts}) experts a token"
            )
        for name in ("shared_expert_intermediate_size", "n_shared_experts"):
            if cfg.get(name) and model_type not in SHARED_EXPERT_TYPES:
                raise UnsupportedModel(
                    name, cfg[name], f"shared experts are implemented for {SHARED_EXPERT_TYPES}"
                )
        layers = int(cfg.get("num_hidden_layers") or 0)
        shared = cfg.get("shared_expert_intermediate_size")
        dense = not all(moe_layers(cfg, layers)) and experts
        qwen = model_type in SHARED_EXPERT_TYPES and model_type not in BLOCK_TYPES
        if qwen and dense and shared != cfg.get("intermediate_size"):
            raise UnsupportedModel(
                "mlp_only_layers",
                cfg.get("mlp_only_layers"),
                "dense layers beside shared experts of another width are not implemented",
            )
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4" and model_type in SINK_TYPES:
        pass  # gpt-oss's experts as they ship: worker/weights/mxfp4.py
    elif cfg.get("quantization_config"):
        method = method or "?"
        raise UnsupportedModel(
            "quantization_config.quant_method",
            method,
            "quantized checkpoints are not loaded as they ship; dequantize to bf16/fp16 first",
        )
    kinds = ("full_attention", "sliding_attention")
    kinds += ("linear_attention",) if model_type in DELTA_NET_TYPES else ()
    kinds += ("conv",) if model_type in SHORT_CONV_TYPES else ()
    kinds += ("mamba", "linear_attention", "attention") if model_type in MAMBA_TYPES else ()
    kinds += ("mlp", "moe") if model_type in BLOCK_TYPES else ()
    for name in ("mamba_proj_bias", "projectors_bias"):
        if model_type in MAMBA_TYPES and cfg.get(name):
            raise UnsupportedModel(name, True, "Mamba2 projections with biases are not implemented")
    if model_type in SHORT_CONV_TYPES and cfg.get("conv_bias"):
        raise UnsupportedModel("conv_bias", True, "short convs with biases are not implemented")
    for layer_type in set(cfg.get("layer_types") or ()):
        if layer_type not in kinds:
            raise UnsupportedModel("layer_types", layer_type, f"{model_type} has {kinds} layers")
    if model_type in DELTA_NET_TYPES and int(cfg.get("linear_num_value_heads") or 0) % int(
        cfg.get("linear_num_key_heads") or 1
    ):
        raise UnsupportedModel(
            "linear_num_value_heads",
            cfg["linear_num_value_heads"],
            "value heads must be a multiple of the key heads",
        )


def num_experts(cfg: dict) -> int:
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return int(next((cfg[k] for k in keys if cfg.get(k)), 0))


def block_kinds(cfg: dict, num_layers: int) -> tuple[str, ...]:
    """Nemotron-H's layer kinds (mamba, attention, mlp, moe); () for other families."""
    if cfg.get("model_type") not in BLOCK_TYPES:
        return ()
    pattern = cfg.get("hybrid_override_pattern")
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None and isinstance(pattern, str):
        kinds = [PATTERN_KINDS.get(ch, ch) for ch in pattern]
    kinds = [BLOCK_KINDS.get(k, k) for k in kinds or ()]
    if len(kinds) < num_layers or set(kinds) - {"mamba", "attention", "mlp", "moe"}:
        raise UnsupportedModel(
            "layers_block_type",
            kinds,
            f"needs one of mamba, attention, mlp, moe a layer, {num_layers}",
        )
    return tuple(kinds[:num_layers])


def moe_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """Layers whose MLP is a mixture of experts; () for a dense model."""
    if cfg.get("model_type") in GEMMA4_TYPES:  # beside every layer's dense MLP, or none
        return (True,) * num_layers if cfg.get("enable_moe_block") and num_experts(cfg) else ()
    if cfg.get("model_type") not in MOE_TYPES or not num_experts(cfg):
        return ()
    if cfg.get("model_type") in ALL_MOE_TYPES:
        return (True,) * num_layers
    if cfg.get("model_type") in BLOCK_TYPES:
        return tuple(kind == "moe" for kind in block_kinds(cfg, num_layers))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def rope_sets(cfg: dict) -> list[dict]:
    """RoPE parameters per layer kind: one set, or Gemma 3's global then sliding."""
    params = cfg.get("rope_parameters") or {}
    per_type = "full_attention" in params or "sliding_attention" in params
    if cfg.get("model_type") != "gemma3_text" and not per_type:
        rope = dict(params or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        return [rope]
    if per_type:  # one set a layer type (Gemma 3, OLMo 3)
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params or cfg.get("rope_scaling") or {}), {}
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return [full, local]
