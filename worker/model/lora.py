"""LoRA adapters beside the base projections, many in one step (`StepLora`), from those a worker
holds (`LoraCache`). Under tensor parallelism A and B are split as the base weight is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger("worker.model.lora")

# the layer's fused projections, each with its parts in output order
PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class Projection:
    """One adapter's update of one fused projection on this rank: A stacked, each part's B apart."""

    a: torch.Tensor
    bs: tuple[torch.Tensor, ...]
    parts: tuple[tuple[int, int, int, int], ...]

    @property
    def lo(self) -> int:
        return min(p[2] for p in self.parts)

    @property
    def hi(self) -> int:
        return max(p[3] for p in self.parts)

    def dense_b(self) -> torch.Tensor:
        """One B over every part's columns, so one matmul expands them all."""
        b = torch.zeros(
            self.hi - self.lo, self.a.shape[0], dtype=self.a.dtype, device=self.a.device
        )
        for part, (a_lo, a_hi, o_lo, o_hi) in zip(self.bs, self.parts, strict=True):
            b[o_lo - self.lo : o_hi - self.lo, a_lo:a_hi] = part
        return b


@dataclass
class LoraWeights:
    """One adapter on this rank: per layer, the projections it changes."""

    identity: str
    layers: list[dict[str, Projection]]
    # the fused decode step's description of it (model/fused_decode.py), made once
    native: object = None

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for p in layer.values()
            for t in (p.a, *p.bs)
        )


class StepLora:
    """A step's rows grouped by adapter; each projection adds shrink then expand per group (two
    Triton launches on a GPU).
    """

    def __init__(
        self,
        groups: list[tuple[LoraWeights, torch.Tensor | None]],
        batched: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        stacks: dict | None = None,
        adapters: list[LoraWeights] | None = None,
        index: torch.Tensor | None = None,
    ) -> None:
        self.groups = groups
        # the step's adapters and each token's index (-1: base), for the fused step
        self.adapters = adapters if adapters is not None else [w for w, _ in groups]
        self.index = index
        self.native = None  # the fused decode step's PsLora of them, where it runs the step
        # on a GPU: two Triton launches per projection over all tokens
        self.gpu = index is not None and index.is_cuda
        self.gpu_index = index.to(torch.int32) if self.gpu else None
        # (gather index [G, most], pad mask [G, most, 1], scatter index [G * most])
        self.batched = batched
        self.stacks = stacks if stacks is not None else {}

    @classmethod
    def of(
        cls, adapters: list[LoraWeights], token_index: torch.Tensor, stacks: dict | None = None
    ) -> StepLora | None:
        """token_index: int64 [num_tokens], each token's adapter in `adapters`
        (-1: the base model).
        """
        groups = []
        for i, weights in enumerate(adapters):
            rows = torch.nonzero(token_index == i).flatten()
            if rows.numel() == token_index.numel():
                groups.append((weights, None))
            elif rows.numel():
                groups.append((weights, rows))
        if not groups:
            return None
        most = max(r.numel() for _, r in groups if r is not None) if len(groups) > 1 else 0
        if len(groups) < 2 or len(groups) * most > 2 * token_index.numel() + 64:
            return cls(groups, stacks=stacks, adapters=adapters, index=token_index)
        gather = torch.zeros(len(groups), most, dtype=torch.int64, device=token_index.device)
        mask = torch.zeros(len(groups), most, 1, device=token_index.device)
        for g, (_, rows) in enumerate(groups):
            gather[g, : rows.numel()] = rows
            mask[g, : rows.numel()] = 1.0
        return cls(groups, (gather, mask, gather.flatten()), stacks, adapters, token_index)

    def _stacked(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """Every group's A and B stacked where all change the projection alike, else None."""
        key = (layer, name)
        if key not in self.stacks:
            ps = [w.layers[layer].get(name) for w, _ in self.groups]
            same = all(
                p is not None
                and p.a.shape == ps[0].a.shape
                and (p.lo, p.hi) == (ps[0].lo, ps[0].hi)
                for p in ps
            )
            self.stacks[key] = (
                None
                if not same
                else (
                    torch.stack([p.a.t() for p in ps]),
                    torch.stack([p.dense_b().t() for p in ps]),
                    ps[0].lo,
                    ps[0].hi,
                )
            )
        return self.stacks[key]

    def _gpu_stack(self, layer: int, name: str):
        """A [G, R, in] and B [G, S, R] for the Triton kernels; None if none changes this
        projection.
        """
        key = ("gpu", layer, name)
        if key not in self.stacks:
            ps = [w.layers[layer].get(name) for w in self.adapters]
            live = [p for p in ps if p is not None]
            if not live:
                self.stacks[key] = None
                return None
            ref = live[0].a
            rank, span = max(p.a.shape[0] for p in live), max(p.hi - p.lo for p in live)
            a = torch.zeros(len(ps), rank, ref.shape[1], dtype=ref.dtype, device=ref.device)
            b = torch.zeros(len(ps), span, rank, dtype=ref.dtype, device=ref.device)
            lo = torch.zeros(len(ps), dtype=torch.int32)
            spans = torch.zeros(len(ps), dtype=torch.int32)
            for g, p in enumerate(ps):
                if p is not None:
                    a[g, : p.a.shape[0]] = p.a
                    b[g, : p.hi - p.lo, : p.a.shape[0]] = p.dense_b()
                    lo[g], spans[g] = p.lo, p.hi - p.lo
            self.stacks[key] = (a, b, lo.to(ref.device), spans.to(ref.device))
        return self.stacks[key]

    def apply(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base projection of x, [rows, out]) with every group's update added, in place."""
        if self.gpu:
            stack = self._gpu_stack(layer, name)
            if stack is not None:
                from kernels.triton_lora import lora_update

                lora_update(x, *stack, self.gpu_index, out)
            return out
        stacked = self._stacked(layer, name) if self.batched is not None else None
        if stacked is not None:
            a, b, lo, hi = stacked  # [G, in, r], [G, r, hi - lo]
            gather, mask, scatter = self.batched
            delta = torch.bmm(torch.bmm(x[gather].to(a.dtype), a), b) * mask  # pads add nothing
            out[:, lo:hi].index_add_(0, scatter, delta.reshape(-1, hi - lo).to(out.dtype))
            return out
        for weights, rows in self.groups:
            p = weights.layers[layer].get(name)
            if p is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            # shrink to sum r, then each part expands its own columns
            t = xs.to(p.a.dtype) @ p.a.t()
            for b, (a_lo, a_hi, o_lo, o_hi) in zip(p.bs, p.parts, strict=True):
                delta = (t[:, a_lo:a_hi] @ b.t()).to(out.dtype)
                if rows is None:
                    out[:, o_lo:o_hi] += delta
                else:
                    out[:, o_lo:o_hi].index_add_(0, rows, delta)
        return out


class LoraCache:
    """Adapters held by content hash, at most `slots`; the least recently used outside the step
    goes.
    """

    def __init__(
        self, slots: int, max_rank: int, loader: Callable[[str, str], LoraWeights]
    ) -> None:
        self.slots, self.max_rank = slots, max_rank
        self.loader = loader
        self.held: OrderedDict[str, LoraWeights] = OrderedDict()
        self.stacks_of: tuple[str, ...] = ()  # the adapters (in step order) `stacks` holds stacked
        self.stacks: dict = {}

    def preload(self, loras: list[tuple[str, str]]) -> None:
        """Read adapters ahead of the plans naming them, into free slots only."""
        for identity, path in loras:
            if identity in self.held or len(self.held) >= self.slots:
                continue
            try:
                self.held[identity] = self.loader(identity, path)
            except (OSError, ValueError) as e:
                log.warning("lora_preload_failed", identity=identity[:16], path=path, error=str(e))
                continue
            log.info("lora_preloaded", identity=identity[:16], path=path)

    def step(
        self, loras: list[tuple[str, str]], seq_index, q_lens, device: torch.device
    ) -> StepLora | None:
        """The step's adapters found or read, rows grouped; ValueError if they cannot be held or
        read.
        """
        if len(loras) > self.slots:
            raise ValueError(
                f"the step names {len(loras)} LoRA adapters; this worker holds {self.slots} "
                "(--max-cpu-loras)"
            )
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
        index = torch.repeat_interleave(
            torch.as_tensor(seq_index, dtype=torch.int64),
            torch.as_tensor(q_lens, dtype=torch.int64),
        ).to(device)
        key = tuple(w.identity for w in wanted)
        # the last step's stacked adapters serve this one only if they are the same
        if key != self.stacks_of:
            self.stacks_of, self.stacks = key, {}
        return StepLora.of(wanted, index, self.stacks)
