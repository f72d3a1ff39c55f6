"""Model shape and hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly")

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        num_heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
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
