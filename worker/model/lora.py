"""LoRA adapters applied beside the base model's projections, many adapters in one step: each row gets its
own adapter's low-rank update added to every projection it changes (`StepLora`), from the adapters a worker
holds (`LoraCache`). Under tensor parallelism a rank holds A and B split as the base weight is: B by rows for
QKV and gate+up, A by columns for o_proj and down (the partial updates meet in the layer's all-reduce)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# the layer's fused projections and, for each, its parts in output order (an adapter may change any of them)
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass
class Projection:
    """One adapter's update of one fused projection on this rank: A of every part it changes, stacked
    [sum r, in], and each part's (B [out_part, r] x scale, its columns lo:hi of the output, its rows of A)."""

    a: torch.Tensor
    parts: list[tuple[torch.Tensor, int, int, int, int]]  # (B, out lo, out hi, A row lo, A row hi)


@dataclass
class LoraWeights:
    """One adapter on this rank: per layer, the projections it changes."""

    identity: str
    layers: list[dict[str, Projection]]

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + sum(b.numel() * b.element_size() for b, *_ in p.parts)
                   for layer in self.layers for p in layer.values())


class StepLora:
    """A step's rows grouped by adapter once: the token rows of each (None where one adapter has every row).
    Every projection then adds, for each group, shrink (x @ A^T, r columns) then expand (@ B^T, the scale
    folded into B) into its rows in place (index_add); a fused projection (QKV, gate+up) stacks its parts'
    A so each group shrinks once, then expands into each part's columns."""

    def __init__(self, groups: list[tuple[LoraWeights, torch.Tensor | None]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, adapters: list[LoraWeights], token_index: torch.Tensor) -> StepLora | None:
        """token_index: int64 [num_tokens], each token's adapter in `adapters` (-1: the base model)."""
        groups = []
        for i, weights in enumerate(adapters):
            rows = torch.nonzero(token_index == i).flatten()
            if rows.numel() == token_index.numel():
                groups.append((weights, None))
            elif rows.numel():
                groups.append((weights, rows))
        return cls(groups) if groups else None

    def apply(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base projection of x, [rows, out]) with every group's update added, in place."""
        for weights, rows in self.groups:
            p = weights.layers[layer].get(name)
            if p is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs.to(p.a.dtype) @ p.a.t()  # [rows, sum r]
            for b, lo, hi, a_lo, a_hi in p.parts:
                delta = (shrunk[:, a_lo:a_hi] @ b.t()).to(out.dtype)
                if rows is None:
                    out[:, lo:hi] += delta
                else:
                    out[:, lo:hi].index_add_(0, rows, delta)
        return out


class LoraCache:
    """The adapters this worker holds, by identity (the hash of their files the scheduler names them by);
    `slots` at most (their memory was set aside from the KV pool's budget), the least recently used one not
    in the current step given back for a new one, which the loader (worker/weights/lora.py) reads the first
    time a plan names it."""

    def __init__(self, slots: int, max_rank: int, loader: Callable[[str, str], LoraWeights]) -> None:
        self.slots, self.max_rank = slots, max_rank
        self.loader = loader
        self.held: OrderedDict[str, LoraWeights] = OrderedDict()

    def step(self, loras: list[tuple[str, str]], seq_index, q_lens, device: torch.device) -> StepLora | None:
        """The step's adapters read or found, and its rows grouped by them; ValueError for a plan that names
        more adapters than this worker holds, or one that cannot be read."""
        if len(loras) > self.slots:
            raise ValueError(f"the step names {len(loras)} LoRA adapters; this worker holds {self.slots} "
                             "(--max-cpu-loras)")
        wanted = []
        for identity, path in loras:
            weights = self.held.get(identity)
            if weights is None:
                while len(self.held) >= self.slots:
                    victim = next(i for i in self.held if i not in {x for x, _ in loras})
                    del self.held[victim]
                weights = self.held[identity] = self.loader(identity, path)
            self.held.move_to_end(identity)
            wanted.append(weights)
        index = torch.repeat_interleave(torch.as_tensor(seq_index, dtype=torch.int64),
                                        torch.as_tensor(q_lens, dtype=torch.int64)).to(device)
        return StepLora.of(wanted, index)
