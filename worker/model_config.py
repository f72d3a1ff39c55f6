"""Model shape and hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """A config field changes the computation in a way this model code does not implement."""

    def __init__(self, field_name: str, value, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field_name, self.value = field_name, value


def check_supported(cfg: dict) -> None:
    """Refuse, naming the field and its value, every config field that would change the math and that the
    model code does not implement — rather than serve wrong text without a word. What is implemented:
    docs (README, "Models")."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel("hidden_act", act, "only the SiLU-gated MLP is implemented")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias", cfg["mlp_bias"], "MLP projections with biases are not implemented")
    if cfg.get("attention_bias") and model_type != "qwen2":  # Qwen2's q/k/v biases are; an o_proj bias is not
        raise UnsupportedModel("attention_bias", cfg["attention_bias"],
                               f"{model_type} puts a bias on o_proj too, which is not implemented")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModel("rope_scaling.rope_type", kind, f"implemented: {', '.join(ROPE_TYPES)}")
    for name, value in (("partial_rotary_factor", rope.get("partial_rotary_factor")),
                        ("partial_rotary_factor", cfg.get("partial_rotary_factor"))):
        if value is not None and float(value) != 1.0:
            raise UnsupportedModel(name, value, "partial rotary embeddings are not implemented")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping"):
        if cfg.get(name) is not None:
            raise UnsupportedModel(name, cfg[name], "logit soft-capping is not implemented")
    for name in ("embedding_multiplier", "scale_emb", "logits_scaling", "residual_multiplier",
                 "attention_multiplier"):
        if cfg.get(name) not in (None, 1, 1.0):
            raise UnsupportedModel(name, cfg[name], "scaled embeddings, residuals or logits are not implemented")
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(name):
            raise UnsupportedModel(name, cfg[name], "mixture-of-experts layers are not implemented")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise UnsupportedModel("quantization_config.quant_method", method,
                               "quantized checkpoints are not loaded as they ship; dequantize to bf16/fp16 first")
    for layer_type in set(cfg.get("layer_types") or ()):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise UnsupportedModel("layer_types", layer_type, "only full and sliding-window attention layers")


def sliding_window_cap(cfg: dict) -> int | None:
    """The context that keeps sliding-window attention exact: a window applies to no sequence shorter than
    it, so a model whose layers slide over W keys is served with its context capped at W (None: no layer
    slides). Mistral's sliding_window; Qwen2/Qwen3/SmolLM3's use_sliding_window and layer_types."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    model_type = cfg.get("model_type", "llama")
    if model_type == "mistral":
        return int(window)
    if "sliding_attention" in (cfg.get("layer_types") or ()):
        return int(window)
    if cfg.get("use_sliding_window"):
        return int(window)
    return None


def rope_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers apply RoPE: all, but SmolLM3's NoPE layers (no_rope_layers, 1 = RoPE, 0 = none; by
    default every no_rope_layer_interval-th layer, as transformers builds it)."""
    if cfg.get("model_type") != "smollm3":
        return (True,) * num_layers
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise UnsupportedModel("no_rope_layers", flags, f"needs one entry for each of the {num_layers} layers")
    return tuple(bool(f) for f in flags[:num_layers])


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
    model_type: str = "llama"
    # per layer: whether it applies RoPE (SmolLM3's NoPE layers do not); empty = every layer
    rope_layers: tuple[bool, ...] = ()
    # the context the model declares, before a sliding window capped it (max_position_embeddings)
    declared_context: int = 0

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly")

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """Raises UnsupportedModel for a field the model code does not implement (check_supported)."""
        check_supported(cfg)
        model_type = cfg.get("model_type", "llama")
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        declared = int(cfg.get("max_position_embeddings", 2048))
        window = sliding_window_cap(cfg)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            max_position_embeddings=min(declared, window) if window else declared,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            rope_layers=rope_layers(cfg, num_layers),
            declared_context=declared,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def fingerprint(self, source: str) -> str:
        blob = json.dumps({"config": asdict(self), "source": source}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def rope_inv_freq(self) -> list[float]:
        """Inverse frequencies of the rotary embedding, with the scaling the config asks for."""
        dim = self.head_dim
        inv = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default"
        if kind == "default":
            return inv
        if kind == "linear":
            factor = float(self.rope_scaling["factor"])
            return [f / factor for f in inv]
        if kind == "llama3":
            factor = float(self.rope_scaling["factor"])
            low = float(self.rope_scaling.get("low_freq_factor", 1.0))
            high = float(self.rope_scaling.get("high_freq_factor", 4.0))
            old_ctx = float(self.rope_scaling.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            out = []
            for f in inv:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / factor)
                else:
                    smooth = (old_ctx / wavelen - low) / (high - low)
                    out.append((1 - smooth) * f / factor + smooth * f)
            return out
        raise ValueError(f"rope scaling {kind!r} is not supported")
