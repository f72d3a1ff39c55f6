"""Rotary frequencies of a ModelConfig, as transformers computes them: the plain ones and their
scalings (linear, Llama 3, YaRN with its attention factor, proportional), divided by a GGUF's
rope_freqs factors where it has them.
"""

from __future__ import annotations

import math

from worker.model.families import UnsupportedModel


def attention_factor(config) -> float:
    """What YaRN multiplies cos and sin by (1 for the other RoPE types)."""
    return _yarn(config)[1] if _kind(config) == "yarn" else 1.0


def _kind(config) -> str:
    return config.rope_scaling.get("rope_type") or config.rope_scaling.get("type") or "default"


def _yarn(config) -> tuple[list[float], float]:
    """YaRN's inverse frequencies and attention factor, computed as transformers does (float32
    ramps).
    """
    import torch

    r, dim, base = config.rope_scaling, config.rotary_dim, config.rope_theta
    original = float(r.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = r.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / original

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = r.get("attention_factor")
    if attention is None:
        mscale, mscale_all = r.get("mscale"), r.get("mscale_all_dim")
        attention = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            if mscale and mscale_all
            else get_mscale(factor)
        )
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.tolist(), float(attention)


def inv_freq(config) -> list[float]:
    """Rotary inverse frequencies with the config's scaling and
    the GGUF's rope_freqs factors.
    """
    inv = _scaled(config)
    if not config.rope_freq_factors:
        return inv
    if len(config.rope_freq_factors) != len(inv):
        raise UnsupportedModel(
            "rope_freqs",
            len(config.rope_freq_factors),
            f"the GGUF's rope_freqs holds {len(config.rope_freq_factors)} factors where "
            f"the rotary embedding has {len(inv)} frequencies",
        )
    return [f / factor for f, factor in zip(inv, config.rope_freq_factors, strict=True)]


def _scaled(config) -> list[float]:
    dim = config.rotary_dim
    inv = [1.0 / (config.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    kind = _kind(config)
    # dynamic: transformers' base grows only past max_position_embeddings
    if kind in ("default", "dynamic"):
        return inv
    if kind == "proportional":  # the first of each head's frequencies turn, the rest stand
        fraction = float(config.rope_scaling.get("partial_rotary_factor", 1.0))
        turning = int(fraction * dim // 2)
        factor = float(config.rope_scaling.get("factor", 1.0))
        return [f / factor if i < turning else 0.0 for i, f in enumerate(inv)]
    if kind == "yarn":
        return _yarn(config)[0]
    if kind == "linear":
        factor = float(config.rope_scaling["factor"])
        return [f / factor for f in inv]
    if kind == "llama3":
        factor = float(config.rope_scaling["factor"])
        low = float(config.rope_scaling.get("low_freq_factor", 1.0))
        high = float(config.rope_scaling.get("high_freq_factor", 4.0))
        old_ctx = float(config.rope_scaling.get("original_max_position_embeddings", 8192))
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
