"""Sampling on the worker's device: greedy, temperature, min-p, top-k, top-p, per-request seed. The
draw for a sequence's k-th token is keyed by (seed, k) alone, so a replay draws the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import top_p_floor_torch

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
    """A row of logits with no finite value (broken weights)."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 logits -> int64 tokens; NaN never wins, +inf always does. Syncs: the runner uses
    sample_async.
    """
    tokens = sample_async(logits, batch)
    check_sampled(tokens.cpu())
    return tokens


def check_sampled(tokens) -> None:
    """Raise NonFiniteLogits where sample_async marked a row with no finite logit (-1)."""
    empty = int((tokens < 0).sum())
    if empty:
        raise NonFiniteLogits(f"the model produced no finite logits for {empty} row(s)")


def sample_async(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """sample() without a host sync; a row with no finite logit gives -1."""
    temperature = batch.temperature.cpu()
    if logits.device.type == "cpu" and not bool((temperature >= MIN_TEMPERATURE).any()):
        # all greedy: one native pass over the vocabulary on the host instead of four; same tokens
        native = _native()
        if native is not None and logits.dtype == torch.float32:
            return native.argmax_rows(logits)
        best, tokens = logits.max(dim=-1)  # the first maximal index, as argmax
        # a row holding a NaN takes the general path, which masks it
        if not bool(best.isnan().any()):
            return torch.where(best == float("-inf"), -1, tokens)
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    tokens = logits.argmax(dim=-1)
    empty = logits.amax(dim=-1) == float("-inf")
    host_rows = (temperature >= MIN_TEMPERATURE).nonzero().flatten()
    if host_rows.numel():
        device = logits.device
        rows = host_rows.to(device, non_blocking=True)
        scaled = logits[rows] / temperature[host_rows].to(device, non_blocking=True)[:, None]
        # +inf (or overflow) stays the largest, finite
        scaled = scaled.clamp(max=torch.finfo(torch.float32).max)
        if batch.min_p is not None and bool((batch.min_p.cpu()[host_rows] > 0).any()):
            # p < min_p * p_max  <=>  scaled < max(scaled) + log(min_p); log(0) = -inf: off
            floor = torch.log(batch.min_p.cpu()[host_rows].to(device, non_blocking=True))
            scaled = scaled.masked_fill(
                scaled < scaled.amax(dim=-1, keepdim=True) + floor[:, None], float("-inf")
            )
        top_k = batch.top_k.cpu()[host_rows]
        # the k-th largest of each row from one partial selection, no sort
        if bool((top_k > 0).any()):
            vocab = scaled.shape[-1]
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            kth = scaled.topk(int(k.max()), dim=-1).values.gather(
                -1, (k - 1).to(device, non_blocking=True)[:, None]
            )
            # ties with the k-th value all stay
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        top_p = batch.top_p.cpu()[host_rows]
        if bool((top_p < 1.0).any()):
            floor = _top_p_floor(probs, top_p.to(torch.float32).to(device, non_blocking=True))
            probs = probs.masked_fill(probs < floor[:, None], 0.0)
        keys = [mix_seed(batch.seeds[r], batch.sample_index[r]) for r in host_rows.tolist()]
        noise = exponential_noise(
            torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True), probs.shape[-1]
        )
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with one keyed stream
        # per row.
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return torch.where(empty, -1, tokens)


def _native():
    """The native CPU kernels where they load (worker/serve/main.py builds them at start), else
    None.
    """
    from kernels import cpu_native

    return cpu_native.load()


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest kept probability under top-p: Triton on CUDA, torch elsewhere."""
    if probs.is_cuda:
        try:
            from kernels.triton_sampling import top_p_floor
        except ImportError:
            pass
        else:
            return top_p_floor(probs, top_p)
    return top_p_floor_torch(probs, top_p)


# splitmix64's constants as wrapping int64 (two's complement): torch's int64 multiply wraps like
# uint64's.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 viewed as uint64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise where (r, v) depends on keys[r] and v alone, so devices and replays agree."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + v[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return -torch.log(uniform_from_bits(_shr(z, 64 - UNIFORM_BITS)))


# 24 bits would round the top draw to 1.0, whose -log is 0, and let a filtered token (probability 0)
# win the race as 0 / 0 = NaN; (k + 0.5) / 2^23 lies strictly in (0, 1).
UNIFORM_BITS = 23


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^UNIFORM_BITS) -> float32 uniforms strictly inside (0, 1)."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
