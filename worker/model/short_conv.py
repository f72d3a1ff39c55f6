"""An LFM gated short-conv block: in_proj gives B, C and x; B * x runs through a causal depthwise
conv whose last inputs are the sequence's slot of the state pool; C gates what comes out, then
out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_recurrent import PsConv
from kernels.delta_rule import causal_conv, causal_conv_step
from worker.model.delta_net import StateStep, copy_after, walk_rows


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel: int) -> None:
        """channels: this rank's share of the hidden size."""
        super().__init__()
        self.channels = channels
        self.conv = nn.Parameter(torch.empty(channels, kernel))
        self._native = None

    @property
    def out_width(self) -> int:
        return self.channels

    @property
    def in_rows(self) -> int:
        """in_proj's rows: B, C, x."""
        return 3 * self.channels

    def native(self, conv_states: torch.Tensor) -> PsConv | None:
        """This block over its layer of the state pool as the fused step reads it (fp32 on a CPU),
        or None; made once a pool.
        """
        if self._native is not None and self._native[0] == conv_states.data_ptr():
            return self._native[1]
        conv = self.conv.detach()
        if not all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            for t in (conv, conv_states)
        ):
            return None
        desc = PsConv(conv.data_ptr(), conv_states.data_ptr(), self.channels, conv.shape[1])
        self._native = (conv_states.data_ptr(), desc, (conv, conv_states))
        return desc

    def forward(self, proj: torch.Tensor, step: StateStep, conv_states, ops=None) -> torch.Tensor:
        """proj [tokens, 3 * channels] -> [tokens, channels]; each row's slot advances past its
        tokens.
        """
        b, c, x = proj.split(self.channels, dim=-1)
        bx = b * x
        if step.decode_only:
            slots = step.slots
            y, conv_states[slots] = causal_conv_step(bx, conv_states[slots], self.conv, False)
        else:
            y = torch.empty_like(bx)

            def advance(s: int, e: int, slot: int) -> torch.Tensor:
                out, conv_states[slot] = causal_conv(bx[s:e], conv_states[slot], self.conv, False)
                return out

            walk_rows(step, (conv_states,), advance, y)
        copy_after(step, (conv_states,))
        return c * y
