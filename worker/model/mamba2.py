"""A Mamba2 mixer (Granite 4, Nemotron-H, Falcon-H1): in_proj gives the gate z, x with B and C, and
a step size a head; x, B and C run through a causal conv (the conv state), then the state-space
scan (the SSD state, fp32) over the sequence's slot of the state pool; a gated RMSNorm by groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_recurrent import MAMBA_NORMS, PsMamba
from kernels.delta_rule import causal_conv, causal_conv_step, ssd_chunked, ssd_step
from worker.model.config import ModelConfig
from worker.model.delta_net import StateStep, copy_after, walk_rows


class Mamba2(nn.Module):
    def __init__(self, config: ModelConfig, size: int = 1) -> None:
        """size: the tensor-parallel ranks sharing its heads and groups (this rank holds 1/size)."""
        super().__init__()
        c = config
        self.heads, self.head_dim = c.mamba_heads // size, c.mamba_head_dim
        self.groups, self.d_state = c.mamba_groups // size, c.mamba_d_state
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.d_state
        self.dt_min = c.mamba_dt_min
        self.norm_kind = c.mamba_norm
        self.eps = c.rms_norm_eps
        self.conv = nn.Parameter(torch.empty(self.conv_dim, c.mamba_conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.a_log = nn.Parameter(torch.zeros(self.heads))
        self.d = nn.Parameter(torch.ones(self.heads))
        self.norm = nn.Parameter(torch.ones(self.inner))
        # (its pool layer's data pointer, the PsMamba, the tensors it points at)
        self._native: tuple | None = None

    @property
    def out_width(self) -> int:
        return self.inner

    @property
    def in_rows(self) -> int:
        """in_proj's rows: z, then x, B, C, then dt."""
        return self.inner + self.conv_dim + self.heads

    def forward(self, proj: torch.Tensor, step: StateStep, conv_states, ssm_states, ops=None):
        """proj [tokens, in_rows] -> [tokens, inner], gated-normed; each row's slot advances."""
        kernels = getattr(ops, "k", None)
        if step.decode_only and hasattr(kernels, "mamba_step"):  # the native library: one call
            y = kernels.mamba_step(self.native(conv_states, ssm_states), proj, step.slots)
            if y is not None:
                copy_after(step, (conv_states, ssm_states))
                return y.to(proj.dtype)
        z, xbc, dt = proj.split([self.inner, self.conv_dim, self.heads], dim=-1)
        # step sizes floored where the model was trained with a floor (transformers floors them in
        # prompts only: here decodes too, so that a recomputed sequence computes what it decoded)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)
        a = -torch.exp(self.a_log.float())
        bias, y = self.conv_bias, None
        if step.decode_only and hasattr(kernels, "mamba_decode"):  # Triton on CUDA
            pools = (conv_states, ssm_states, step.slots, self.conv, bias, self.shape)
            y = kernels.mamba_decode(xbc, dt, a, self.d, *pools)
        if y is not None:
            pass
        elif step.decode_only:
            slots = step.slots
            xbc, conv_states[slots] = causal_conv_step(
                xbc, conv_states[slots], self.conv, True, bias
            )
            y, ssm_states[slots] = self._scan(ssd_step, xbc, dt, a, ssm_states[slots])
        else:
            y = xbc.new_empty(xbc.shape[0], self.inner, dtype=torch.float32)

            def advance(s: int, e: int, slot: int) -> torch.Tensor:
                out, conv_states[slot] = causal_conv(
                    xbc[s:e], conv_states[slot], self.conv, True, bias
                )
                out, ssm_states[slot] = self._scan(ssd_chunked, out, dt[s:e], a, ssm_states[slot])
                return out

            walk_rows(step, (conv_states, ssm_states), advance, y)
        copy_after(step, (conv_states, ssm_states))
        return self._gated_norm(y, z)

    def native(self, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> PsMamba | None:
        """This mixer over its layer of the state pool as the native library reads it (fp32 on a
        CPU), or None; made once a pool.
        """
        if self._native is not None and self._native[0] == conv_states.data_ptr():
            return self._native[1]
        f32 = torch.float32
        params = [self.conv, self.conv_bias, self.dt_bias, self.d, self.norm]
        if not all(
            t.dtype == f32 and t.device.type == "cpu" and t.is_contiguous()
            for t in (*params, conv_states, ssm_states)
        ):
            return None
        a = -torch.exp(self.a_log.detach().float())
        keep = [p.detach() for p in params] + [a, conv_states, ssm_states]
        ptrs = [t.data_ptr() for t in (*keep[:3], a, keep[3], keep[4], conv_states, ssm_states)]
        dims = (self.heads, self.head_dim, self.groups, self.d_state, self.conv.shape[1])
        kind = MAMBA_NORMS[self.norm_kind]
        desc = PsMamba(*ptrs, *dims, kind, self.dt_min, self.eps)
        self._native = (conv_states.data_ptr(), desc, keep)
        return desc

    @property
    def shape(self) -> tuple:
        """What the decode kernels need to know of this mixer."""
        return (self.heads, self.head_dim, self.groups, self.d_state)

    def _scan(self, scan, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, state):
        """x, B and C out of the conv's output through `scan` (chunked or one step), plus the D
        skip -> (y [rows, inner] fp32, the new state).
        """
        rows, width = xbc.shape[0], self.groups * self.d_state
        x, b, c = xbc.split([self.inner, width, width], dim=-1)
        x = x.reshape(rows, self.heads, self.head_dim)
        groups = (rows, self.groups, self.d_state)
        y, state = scan(x, dt, a, b.reshape(groups), c.reshape(groups), state)
        y = y + self.d.float()[:, None] * x.float()
        return y.reshape(rows, self.inner), state

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y times SiLU of z, RMS-normed in groups, times the norm's weight (Granite, Nemotron-H);
        or normed first, then gated; or only gated (Falcon-H1, as its config says).
        """
        rows, gate = y.shape[0], F.silu(z.float())
        if self.norm_kind == "none":
            return (y * gate).to(z.dtype)
        g = (y if self.norm_kind == "before_gate" else y * gate).view(rows, self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm * g.view(rows, self.inner).to(z.dtype)
        return (out.float() * gate).to(z.dtype) if self.norm_kind == "before_gate" else out
