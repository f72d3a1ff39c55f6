"""Sampling on the worker's device: greedy, temperature, min-p, top-k, top-p, per-request seed.

Stateless: the random draw for a sequence's k-th generated token is keyed by (seed, k) alone, so a
sequence preempted and recomputed, or replayed on a restarted worker, draws exactly the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) -> a 63-bit generator seed."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # float32 [rows]
    top_p: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows]; 0 = off
    seeds: list[int]
    sample_index: list[int]
    min_p: torch.Tensor | None = None  # float32 [rows]; 0 = off


# Temperatures below this draw greedily: dividing by them overflows logits to inf.
MIN_TEMPERATURE = 1e-5


class NonFiniteLogits(ValueError):
    """A row of logits has no finite value to choose from (a broken model or weights)."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: fp32 [rows, vocab] on the worker's device -> int64 [rows] token ids on it. NaN logits never
    win; +inf ones always do. The batch's parameters may live on the host: they are moved once, and every
    index used on a tensor lives on that tensor's device."""
    top = logits.amax(dim=-1)  # NaN where a row holds one: one cheap pass decides whether to clean up
    if bool((top.isnan() | (top == float("-inf"))).any()):
        logits = torch.nan_to_num(logits, nan=float("-inf"))
        empty = torch.isneginf(logits).all(dim=-1)
        if bool(empty.any()):
            raise NonFiniteLogits(f"the model produced no finite logits for {int(empty.sum())} row(s)")
    tokens = logits.argmax(dim=-1)
    host_rows = (batch.temperature.cpu() >= MIN_TEMPERATURE).nonzero().flatten()
    if host_rows.numel() == 0:
        return tokens
    device = logits.device
    rows = host_rows.to(device, non_blocking=True)
    temperature = batch.temperature.cpu()[host_rows].to(device, non_blocking=True)
    scaled = logits[rows] / temperature[:, None]
    scaled = scaled.clamp(max=torch.finfo(torch.float32).max)  # +inf (or overflow) stays the largest, finite
    if batch.min_p is not None:  # p < min_p * p_max  <=>  scaled < max(scaled) + log(min_p); log(0) = -inf: off
        floor = torch.log(batch.min_p.cpu()[host_rows].to(device, non_blocking=True))
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=-1, keepdim=True) + floor[:, None], float("-inf"))
    scaled = _apply_top_k_top_p(scaled, batch.top_k.cpu()[host_rows].to(device, non_blocking=True),
                                batch.top_p.cpu()[host_rows].to(device, non_blocking=True))
    probs = torch.softmax(scaled, dim=-1)
    keys = [mix_seed(batch.seeds[r], batch.sample_index[r]) for r in host_rows.tolist()]
    noise = exponential_noise(torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True), probs.shape[-1])
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with one keyed stream per row.
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


# splitmix64's constants as wrapping int64 (two's complement): torch's int64 multiply wraps like uint64's.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 viewed as uint64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] from a counter-based generator: element (r, v) is a function of keys[r]
    and v alone (splitmix64 of the pair, 23 bits to a uniform in (0, 1), then -log), so one batched pass
    over all rows on any device draws what a replay of the same (seed, token index) draws."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + v[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return -torch.log(uniform_from_bits(_shr(z, 64 - UNIFORM_BITS)))


# Bits of a uniform draw. (k + 0.5) / 2^23 for k < 2^23 is exact in float32 and lies in (0, 1) strictly;
# with 24 bits the top value rounds to 1.0, whose -log is 0, and a token of probability 0 (filtered by
# top-k, top-p, min-p or a mask) would then win the race as 0 / 0 = NaN.
UNIFORM_BITS = 23


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^UNIFORM_BITS) -> float32 uniforms strictly inside (0, 1)."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    if not use_p:  # top-k alone: the k-th largest of each row from one partial selection, no full sort
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th value all stay
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:  # as above: every token tied with the k-th largest stays, whatever else is in the batch
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        mask |= sorted_logits < sorted_logits.gather(-1, (k - 1)[:, None])
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        mask |= before >= top_p[:, None]  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
