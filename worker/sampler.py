"""Sampling on the worker's device: greedy, temperature, top-k, top-p, per-request seed.

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


# Temperatures below this draw greedily: dividing by them overflows logits to inf.
MIN_TEMPERATURE = 1e-5


class NonFiniteLogits(ValueError):
    """A row of logits has no finite value to choose from (a broken model or weights)."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: fp32 [rows, vocab] -> int64 [rows] token ids. NaN logits never win; +inf ones always do."""
    top = logits.amax(dim=-1)  # NaN where a row holds one: one cheap pass decides whether to clean up
    if bool((top.isnan() | (top == float("-inf"))).any()):
        logits = torch.nan_to_num(logits, nan=float("-inf"))
        empty = torch.isneginf(logits).all(dim=-1)
        if bool(empty.any()):
            raise NonFiniteLogits(f"the model produced no finite logits for {int(empty.sum())} row(s)")
    tokens = logits.argmax(dim=-1)
    random_rows = (batch.temperature >= MIN_TEMPERATURE).nonzero().flatten().tolist()
    if not random_rows:
        return tokens
    rows = torch.tensor(random_rows, device=logits.device)
    scaled = logits[rows] / batch.temperature[rows].to(logits.device)[:, None]
    scaled = scaled.clamp(max=torch.finfo(torch.float32).max)  # +inf (or overflow) stays the largest, finite
    scaled = _apply_top_k_top_p(scaled, batch.top_k[rows].to(logits.device), batch.top_p[rows].to(logits.device))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for j, row in enumerate(random_rows):
        g = torch.Generator(device=logits.device).manual_seed(mix_seed(batch.seeds[row], batch.sample_index[row]))
        noise[j].exponential_(generator=g)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with one seeded stream per row.
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        mask |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        mask |= before >= top_p[:, None]  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
