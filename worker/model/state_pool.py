"""The recurrent-state pool beside the paged KV: per slot, each Gated DeltaNet layer's conv inputs
and fp32 delta-rule state. The scheduler assigns slots; the worker holds the bytes.
"""

from __future__ import annotations

import torch

from worker.model.config import ModelConfig


def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, v_heads: int | None = None) -> int:
    """One sequence's state over all linear layers; v_heads: the value heads this rank holds."""
    heads = config.linear_v_heads if v_heads is None else v_heads
    share = heads / config.linear_v_heads if config.linear_v_heads else 0
    conv = int(config.conv_dim * share) * (config.linear_conv_kernel - 1)
    element = torch.empty((), dtype=dtype).element_size()
    recurrent = heads * config.linear_k_dim * config.linear_v_dim * 4
    return sum(config.linear_layers) * (conv * element + recurrent)


class StatePool:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        v_heads: int | None = None,
        conv_dim: int | None = None,
    ) -> None:
        """v_heads, conv_dim: this rank's share (a tensor-parallel rank holds its heads' slice)."""
        heads = config.linear_v_heads if v_heads is None else v_heads
        channels = config.conv_dim if conv_dim is None else conv_dim
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot(config, dtype, heads)
        linear = [i for i in range(config.num_layers) if config.is_linear(i)]
        conv = (num_slots, config.linear_conv_kernel - 1, channels)
        state = (num_slots, heads, config.linear_k_dim, config.linear_v_dim)
        self.conv = {i: torch.zeros(conv, dtype=dtype, device=device) for i in linear}
        self.recurrent = {i: torch.zeros(state, dtype=torch.float32, device=device) for i in linear}

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[idx], self.recurrent[idx]

    @torch.no_grad()
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's state of slots src into slots dst (a snapshot taken or resumed from)."""
        if src.numel():
            for conv, state in zip(self.conv.values(), self.recurrent.values(), strict=True):
                conv[dst] = conv[src]
                state[dst] = state[src]

    @torch.no_grad()
    def reset(self, slots: torch.Tensor) -> None:
        """Zero the slots of sequences that start at position 0."""
        if slots.numel():
            for conv, state in zip(self.conv.values(), self.recurrent.values(), strict=True):
                conv[slots] = 0
                state[slots] = 0
