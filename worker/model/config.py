"""Model shape and hyper-parameters of a Llama-family model, read from its config.json."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from worker.model import rope
from worker.model.families import (
    ALL_MOE_TYPES,
    BLOCK_TYPES,
    GATED_ACTIVATIONS,
    GEMMA4_TYPES,
    GEMMA_TYPES,
    HYBRID_TYPES,
    MULTIPLIER_TYPES,
    POST_NORM_TYPES,
    SHARED_EXPERT_TYPES,
    SHORT_CONV_TYPES,
    SIGMOID_ROUTER_TYPES,
    SINK_TYPES,
    WHOLE_QK_NORM_TYPES,
    check_supported,
    language_config,
    moe_layers,
    num_experts,
    rope_sets,
)
from worker.model.layer_kinds import (
    dense_width,
    gemma4_fields,
    hybrid_fields,
    layer_windows,
    mamba_fields,
    rope_layers,
    short_conv_fields,
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # OLMo 3: q and k normed over the whole projection (all heads together), not head by head
    qk_norm_whole: bool = False
    model_type: str = "llama"
    # per layer: whether it applies RoPE (SmolLM3's NoPE layers do not); empty = every layer
    rope_layers: tuple[bool, ...] = ()
    # per layer: its sliding window (0: full attention); empty = no layer slides
    layer_windows: tuple[int, ...] = ()
    # values of each head that RoPE rotates (partial_rotary_factor)
    rotary_dim: int = 0
    # Gemma 3's sliding layers' own RoPE; None: one for all
    local_rope: dict | None = None
    # a GGUF's rope_freqs: each inverse frequency divided by its factor, as llama.cpp does
    rope_freq_factors: tuple[float, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (GeGLU)
    attn_scale: float = 0.0  # softmax scale of the scores; 0: head_dim ** -0.5
    embed_scale: float = 1.0  # Gemma multiplies its input embeddings by sqrt(hidden_size)
    # Gemma: RMSNorm on the attention and MLP outputs before each residual add
    sandwich_norms: bool = False
    # OLMo 3: only those two; nothing normed before attention or the MLP
    post_norms_only: bool = False
    # OLMo-Hybrid: only its attention layers so (its Gated DeltaNet layers norm before)
    post_norm_layers: tuple[bool, ...] = ()
    # Gemma's RMSNorm scales by (1 + weight): added to every norm weight at load
    norm_offset: float = 0.0
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: off
    attn_softcap: float = 0.0  # Gemma 2: attention scores = cap * tanh(scores / cap); 0: off
    # mixture of experts per layer (empty: dense), experts, top-k, intermediate size,
    # renormalization
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # MiniMax-M2: chosen by sigmoid score + a per-expert correction bias, weighted by the score
    sigmoid_router: bool = False
    # beside the experts, a shared one (intermediate_size wide) scaled by a per-token sigmoid gate
    shared_expert: bool = False
    # hybrids: which layers are Gated DeltaNet (empty: none), their heads, dims and conv width
    linear_layers: tuple[bool, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    # value heads in llama.cpp's order: head j reads key head j % k_heads
    linear_tiled_values: bool = False
    # OLMo-Hybrid: beta times 2 (the delta rule's eigenvalues may go negative); its gated norm's eps
    linear_beta_scale: float = 1.0
    linear_norm_eps: float = 0.0
    attn_output_gate: bool = False
    # LFM: gated short-conv blocks (a conv state per sequence, no K/V) and their kernel width;
    # one sigmoid gate a head on the attention output
    conv_layers: tuple[bool, ...] = ()
    short_conv_kernel: int = 0
    attn_head_gate: bool = False
    # Mamba2 mixers (Granite 4): which layers, heads, head size, B/C groups, state size, conv
    # width, the step size's floor
    mamba_layers: tuple[bool, ...] = ()
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_d_state: int = 0
    mamba_conv_kernel: int = 0
    mamba_dt_min: float = 0.0
    # Granite: each block's output scaled before the residual add; logits multiplied
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Falcon-H1: Mamba2 beside attention in every layer; Mamba2's output norm: gate then norm by
    # groups, norm then gate, or the gate alone; multipliers folded into weights as they are read
    parallel_mamba: bool = False
    mamba_norm: str = "gated"
    weight_scales: dict = field(default_factory=dict)
    # a shared expert scaled by a per-token sigmoid gate (Qwen), or added as it is (Granite)
    shared_expert_gated: bool = True
    # Nemotron-H: layers that are an MLP (or experts) alone, and those that are a mixer alone;
    # MLPs of up, relu², down (not gated); experts chosen within the best groups, weights scaled
    ffn_only_layers: tuple[bool, ...] = ()
    mixer_only_layers: tuple[bool, ...] = ()
    gated_mlp: bool = True
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scale: float = 1.0
    # LFM2-MoE: its sigmoid router may have no correction bias; its renormalization's epsilon
    router_correction: bool = True
    router_norm_eps: float = 1e-20
    # gpt-oss: a learned sink logit per head in every softmax, o_proj and expert biases, and
    # SwiGLU clamped at swiglu_limit with sigmoid(alpha * gate) (0: plain SiLU)
    attn_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # Gemma 4 (docs/models.md): full layers' head size and KV heads, values from the keys'
    # projection, normed; each layer's K/V source, MLP width; per-layer token embeddings; experts
    global_head_dim: int = 0
    global_kv_heads: int = 0
    values_from_keys: bool = False
    v_norm: bool = False
    kv_sources: tuple[int, ...] = ()
    layer_widths: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    moe_beside_mlp: bool = False

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    def is_conv(self, layer: int) -> bool:
        return bool(self.conv_layers) and self.conv_layers[layer]

    def is_mamba(self, layer: int) -> bool:
        return bool(self.mamba_layers) and self.mamba_layers[layer]

    def post_norms(self, layer: int) -> bool:
        """Nothing normed before attention or the MLP; their outputs normed (OLMo 3)."""
        return self.post_norm_layers[layer] if self.post_norm_layers else self.post_norms_only

    def ffn_only(self, layer: int) -> bool:
        return bool(self.ffn_only_layers) and self.ffn_only_layers[layer]

    def mixer_only(self, layer: int) -> bool:
        return bool(self.mixer_only_layers) and self.mixer_only_layers[layer]

    def has_kv(self, layer: int) -> bool:
        """The layer attends over paged K/V."""
        stateless = not self.has_state(layer) or self.parallel_mamba
        return stateless and not self.ffn_only(layer)

    def kv_source(self, layer: int) -> int:
        """The layer whose cached K/V this one reads: itself, or (Gemma 4) an earlier one."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def writes_kv(self, layer: int) -> bool:
        return self.has_kv(layer) and self.kv_source(layer) == layer

    def global_layer(self, layer: int) -> bool:  # a full layer with its own head size (Gemma 4)
        return bool(self.global_head_dim) and not self.window(layer)

    def head_dim_of(self, layer: int) -> int:
        return self.global_head_dim if self.global_layer(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        wider = self.global_layer(layer) and self.global_kv_heads
        return self.global_kv_heads if wider else self.num_kv_heads

    def kv_shape(self, layer: int, tp: int = 1) -> tuple[int, int] | None:
        """(KV heads on a rank of tp, head size) of the K/V the layer writes; None: none."""
        if not self.writes_kv(layer):
            return None
        heads = self.kv_heads_of(layer)
        return (heads // tp if heads >= tp else 1), self.head_dim_of(layer)

    def mlp_width(self, layer: int) -> int:
        return self.layer_widths[layer] if self.layer_widths else self.intermediate_size

    def has_state(self, layer: int) -> bool:
        """The layer keeps per-sequence state in the state pool instead of paged K/V."""
        return self.is_linear(layer) or self.is_conv(layer) or self.is_mamba(layer)

    @property
    def keeps_state(self) -> bool:
        """Some layer keeps a recurrent state per sequence beside (or instead of) paged KV."""
        return any(self.has_state(i) for i in range(self.num_layers))

    @property
    def num_kv_layers(self) -> int:
        """Layers that write paged K/V."""
        return sum(self.writes_kv(i) for i in range(self.num_layers))

    @property
    def conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: q, k and v side by side."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def local_rope_config(self) -> ModelConfig | None:
        """The sliding layers' own RoPE config (Gemma 3); None when all share one."""
        if self.local_rope is None:
            return None
        from dataclasses import replace

        return replace(
            self,
            rope_theta=float(self.local_rope["rope_theta"]),
            local_rope=None,
            rotary_dim=self.head_dim if self.global_head_dim else self.rotary_dim,
            global_head_dim=0,
            rope_scaling={k: v for k, v in self.local_rope.items() if k != "rope_theta"},
        )

    def window(self, layer: int) -> int:
        """The layer's sliding window; 0 = every earlier key."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The widest window if every layer slides, else 0."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not self.attn_scale:
            object.__setattr__(self, "attn_scale", self.head_dim**-0.5)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= max(
            self.head_dim, self.global_head_dim
        ):
            raise ValueError(
                f"a rotary dimension of {self.rotary_dim} does not fit heads of {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly"
            )

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """Raises UnsupportedModel for a field the model code
        does not implement (check_supported).
        """
        cfg = language_config(cfg)
        check_supported(cfg)
        model_type = cfg.get("model_type", "llama")
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        ropes = rope_sets(cfg)
        rope = ropes[0]
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
        # MiniMax-M2's released configs give rotary_dim instead
        legacy = int(cfg.get("rotary_dim") or 0) / head_dim if model_type == "minimax_m2" else 0
        partial = float(
            rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or legacy or 1.0
        )
        if (rope.get("rope_type") or rope.get("type")) == "proportional":
            partial = 1.0  # every value rotates; the frequencies past the fraction are zero
        theta = rope["rope_theta"]
        gemma = model_type in GEMMA_TYPES
        gemma4 = model_type in GEMMA4_TYPES
        g4 = gemma4_fields(cfg, num_layers)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            # (a model whose every MLP is experts: its shared expert's)
            intermediate_size=dense_width(cfg, num_layers),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(
                cfg.get("rms_norm_eps", cfg.get("norm_eps", cfg.get("layer_norm_epsilon", 1e-5)))
            ),
            rope_theta=float(theta),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", model_type in (*SHORT_CONV_TYPES, *GEMMA4_TYPES))
            ),
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", *SINK_TYPES))),
            qk_norm=model_type
            in ("qwen3", "qwen3_moe", "gemma3_text", *HYBRID_TYPES, *WHOLE_QK_NORM_TYPES)
            or model_type in (*SHORT_CONV_TYPES, *GEMMA4_TYPES),
            qk_norm_whole=model_type in WHOLE_QK_NORM_TYPES,
            model_type=model_type,
            rope_layers=rope_layers(cfg, num_layers),
            layer_windows=layer_windows(cfg, num_layers),
            rotary_dim=g4.get("global_head_dim") or int(head_dim * partial),
            local_rope=ropes[1] if len(ropes) > 1 else None,
            hidden_act="relu2" if model_type in BLOCK_TYPES else GATED_ACTIVATIONS[act],
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
            if gemma
            else 1.0
            if gemma4  # its q/k norms scale the scores
            else float(cfg.get("attention_multiplier") or 0.0),
            embed_scale=float(cfg["hidden_size"]) ** 0.5
            if gemma or gemma4
            else float(cfg.get("embedding_multiplier") or 1.0),
            sandwich_norms=gemma
            or gemma4
            or model_type in (*POST_NORM_TYPES, "olmo_hybrid")
            or (model_type in SHORT_CONV_TYPES and cfg.get("use_sandwich_norm", True)),
            post_norms_only=model_type in POST_NORM_TYPES,
            norm_offset=1.0 if gemma or model_type in HYBRID_TYPES else 0.0,
            final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0)
            if gemma or gemma4
            else 0.0,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0)
            if model_type == "gemma2"
            else 0.0,
            moe_layers=moe_layers(cfg, num_layers),
            num_experts=num_experts(cfg),
            experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 0),
            # Mixtral's experts are intermediate_size wide, and it always renormalizes the chosen
            # experts' weights
            moe_intermediate_size=int(
                cfg.get("intermediate_size")
                if model_type in (*ALL_MOE_TYPES, *SINK_TYPES)
                else cfg.get("moe_intermediate_size") or 0
            ),
            # gpt-oss's softmax over the chosen logits is the renormalized top-k of all
            norm_topk_prob=model_type
            in (*ALL_MOE_TYPES, "qwen3_5_moe_text", *SINK_TYPES, *GEMMA4_TYPES)
            or bool(cfg.get("norm_topk_prob", False)),
            sigmoid_router=model_type in SIGMOID_ROUTER_TYPES,
            shared_expert=model_type in SHARED_EXPERT_TYPES and dense_width(cfg, num_layers) > 0,
            shared_expert_gated=model_type not in (*MULTIPLIER_TYPES, *BLOCK_TYPES),
            attn_sinks=model_type in SINK_TYPES,
            o_proj_bias=model_type in SINK_TYPES and bool(cfg.get("attention_bias", True)),
            expert_bias=model_type in SINK_TYPES,
            swiglu_limit=float(cfg.get("swiglu_limit") or 0.0) if model_type in SINK_TYPES else 0.0,
            swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702)
            if model_type in SINK_TYPES
            else 1.0,
            v_norm=gemma4,
            moe_beside_mlp=gemma4 and bool(moe_layers(cfg, num_layers)),
            **g4,
            **hybrid_fields(cfg, num_layers),
            **short_conv_fields(cfg, num_layers),
            **mamba_fields(cfg, num_layers),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def fingerprint(self, source: str) -> str:
        blob = json.dumps({"config": asdict(self), "source": source}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def rope_attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for the other RoPE types)."""
        return rope.attention_factor(self)

    def rope_inv_freq(self) -> list[float]:
        """Rotary inverse frequencies with the config's scaling and the GGUF's rope_freqs
        factors.
        """
        return rope.inv_freq(self)
