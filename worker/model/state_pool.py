"""The recurrent-state pool beside the paged KV: per slot, each stateful layer's tensors, whatever
its kind (a Gated DeltaNet's conv inputs and fp32 delta-rule state; a short-conv block's conv
inputs). The scheduler assigns slots; the worker holds the bytes.
"""

from __future__ import annotations

import torch

from worker.model.config import ModelConfig

Spec = tuple[tuple[int, ...], torch.dtype]  # one tensor's shape for one slot, and its dtype


def state_specs(config: ModelConfig, dtype: torch.dtype, size: int = 1) -> dict[int, list[Spec]]:
    """Each stateful layer's tensors for one slot, on one of `size` tensor-parallel ranks (each
    holds its heads' or channels' share).
    """
    c, specs = config, {}
    for i in range(c.num_layers):
        if c.is_linear(i):
            heads = c.linear_v_heads // size
            specs[i] = [
                ((c.linear_conv_kernel - 1, c.conv_dim // size), dtype),
                ((heads, c.linear_k_dim, c.linear_v_dim), torch.float32),
            ]
        elif c.is_conv(i):
            specs[i] = [((c.short_conv_kernel - 1, c.hidden_size // size), dtype)]
        elif c.is_mamba(i):
            heads, groups = c.mamba_heads // size, c.mamba_groups // size
            conv = heads * c.mamba_head_dim + 2 * groups * c.mamba_d_state
            specs[i] = [
                ((c.mamba_conv_kernel - 1, conv), dtype),
                ((heads, c.mamba_head_dim, c.mamba_d_state), torch.float32),
            ]
    return specs


def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, size: int = 1) -> int:
    """One sequence's state over all stateful layers on one rank."""
    element = {d: torch.empty((), dtype=d).element_size() for d in (dtype, torch.float32)}
    return sum(
        element[d] * int(torch.Size(shape).numel())
        for layer in state_specs(config, dtype, size).values()
        for shape, d in layer
    )


class StatePool:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        size: int = 1,
    ) -> None:
        """size: the tensor-parallel ranks sharing each layer's heads and channels."""
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot(config, dtype, size)
        self.layers = {
            i: tuple(torch.zeros((num_slots, *shape), dtype=d, device=device) for shape, d in spec)
            for i, spec in state_specs(config, dtype, size).items()
        }

    def layer(self, idx: int) -> tuple[torch.Tensor, ...]:
        return self.layers[idx]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers.values() for t in layer]

    @torch.no_grad()
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's state of slots src into slots dst (a snapshot taken or resumed from)."""
        if src.numel():
            for t in self.tensors():
                t[dst] = t[src]

    @torch.no_grad()
    def reset(self, slots: torch.Tensor) -> None:
        """Zero the slots of sequences that start at position 0."""
        if slots.numel():
            for t in self.tensors():
                t[slots] = 0
