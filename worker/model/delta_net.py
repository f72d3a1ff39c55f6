"""A hybrid's linear-attention layer (Gated DeltaNet, Qwen3.5): between its input and output
projections, a causal conv and the gated delta rule over the sequence's slot of the state pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_recurrent import PsDelta
from kernels.delta_rule import (
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    gated_delta_rule_step,
)
from worker.model.config import ModelConfig


@dataclass
class StateStep:
    """A step's rows in the state pool: slots, token offsets, snapshots inside rows and at their
    ends.
    """

    slots: torch.Tensor  # int64 [rows]
    query_start_loc: list[int]  # [rows + 1]
    saves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    after: tuple[torch.Tensor, torch.Tensor] | None = None  # (src slots, dst slots)

    @property
    def decode_only(self) -> bool:
        return not self.saves and self.query_start_loc[-1] == len(self.query_start_loc) - 1


def begin_state_step(states, p, device) -> StateStep | None:
    """Copy in resumed snapshots, zero the slots of rows starting at 0; None if stateless."""
    if states is None or p.state_slots is None:
        return None
    if p.state_copies is not None and p.state_copies.size:
        pairs = torch.from_numpy(p.state_copies.astype("int64").reshape(-1, 2)).to(device)
        states.copy(pairs[:, 0], pairs[:, 1])
    starts = p.query_start_loc[:-1]
    slots = torch.from_numpy(p.state_slots.astype("int64")).to(device)
    fresh = torch.from_numpy(p.positions[starts] == 0).to(device)
    states.reset(slots[fresh])
    loc = p.query_start_loc.tolist()
    saves: dict[int, list[tuple[int, int]]] = {}
    after: list[tuple[int, int]] = []
    if p.state_saves is not None:
        for row, offset, dst in sorted(p.state_saves.reshape(-1, 3).tolist()):
            if offset == loc[row + 1] - loc[row]:
                after.append((int(p.state_slots[row]), dst))
            else:
                saves.setdefault(row, []).append((offset, dst))
    ends = torch.tensor(after, dtype=torch.int64, device=device).T if after else None
    return StateStep(slots, loc, saves, None if ends is None else (ends[0], ends[1]))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, k_heads: int, v_heads: int) -> None:
        """k_heads, v_heads: this rank's (all of them with one rank)."""
        super().__init__()
        c = config
        self.k_heads, self.v_heads = k_heads, v_heads
        self.k_dim, self.v_dim = c.linear_k_dim, c.linear_v_dim
        self.conv_dim = 2 * k_heads * c.linear_k_dim + v_heads * c.linear_v_dim
        self.v_size = self.v_heads * self.v_dim
        self.tiled = c.linear_tiled_values
        self.eps = c.linear_norm_eps or c.rms_norm_eps
        self.beta_scale = c.linear_beta_scale
        self.conv = nn.Parameter(torch.empty(self.conv_dim, c.linear_conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.a_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = nn.Parameter(torch.ones(self.v_dim))  # the gated norm's plain weight
        self._native: tuple | None = None  # (its pool layer's data pointer, PsDelta, its tensors)

    @property
    def out_width(self) -> int:
        return self.v_size

    @property
    def in_rows(self) -> int:
        """Fused input projection rows: q, k, v, z, b, a."""
        return self.conv_dim + self.v_size + 2 * self.v_heads

    def forward(
        self, proj: torch.Tensor, step: StateStep, conv_states, states, ops=None
    ) -> torch.Tensor:
        """proj [tokens, in_rows] -> [tokens, v_size], gated-normed; each row's slot advances past
        its tokens.
        """
        out = self._run(proj, step, conv_states, states, ops)
        copy_after(step, (conv_states, states))
        return out

    def _run(self, proj, step: StateStep, conv_states, states, ops) -> torch.Tensor:
        kernels = getattr(ops, "k", None)
        if step.decode_only and hasattr(kernels, "delta_step"):  # the native library: one call
            out = kernels.delta_step(self.native(conv_states, states), proj, step.slots)
            if out is not None:
                return out.to(proj.dtype)
        x, z, b, a = proj.split([self.conv_dim, self.v_size, self.v_heads, self.v_heads], -1)
        beta = torch.sigmoid(b.float())
        if self.beta_scale != 1.0:  # OLMo-Hybrid: eigenvalues down to -1
            beta = beta * self.beta_scale
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        native = kernels if hasattr(kernels, "delta_net_decode") else None
        if step.decode_only and native is not None:
            pools = (conv_states, states, step.slots)
            out = native.delta_net_decode(x, z, g, beta, *pools, self.conv, self.norm, self.shape)
            if out is not None:
                return out
        if step.decode_only:
            slots = step.slots
            x, conv_states[slots] = causal_conv_step(x, conv_states[slots], self.conv)
            out, states[slots] = gated_delta_rule_step(*self._qkv(x), g, beta, states[slots])
        else:
            out = x.new_empty(x.shape[0], self.v_heads, self.v_dim, dtype=torch.float32)

            def advance(s: int, e: int, slot: int) -> torch.Tensor:
                return self._advance(x, g, beta, (s, e), slot, conv_states, states, native)

            walk_rows(step, (conv_states, states), advance, out)
        return self._gated_norm(out, z)

    def native(self, conv_states: torch.Tensor, states: torch.Tensor) -> PsDelta | None:
        """This layer over its layer of the state pool as the native library reads it (fp32 on a
        CPU), or None; made once a pool.
        """
        if self._native is not None and self._native[0] == conv_states.data_ptr():
            return self._native[1]
        params = [self.conv, self.dt_bias, self.norm]
        if not all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            for t in (*params, conv_states, states)
        ):
            return None
        a_neg = -self.a_log.detach().float().exp()
        keep = [p.detach() for p in params] + [a_neg, conv_states, states]
        ptrs = [t.data_ptr() for t in (keep[0], keep[1], a_neg, keep[2], conv_states, states)]
        dims = (self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.conv.shape[1])
        desc = PsDelta(*ptrs, *dims, int(self.tiled), self.eps, self.beta_scale)
        self._native = (conv_states.data_ptr(), desc, keep)
        return desc

    @property
    def shape(self) -> tuple:
        """What the native kernels need to know of this layer."""
        return (self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.tiled, self.eps)

    def _advance(self, x, g, beta, span, slot: int, conv_states, states, native=None):
        """One row through the conv and delta rule from its slot's state."""
        s, e = span
        y, conv_states[slot] = causal_conv(x[s:e], conv_states[slot], self.conv)
        if native is not None and e - s > 1:
            out = native.delta_rule_chunked(y, g[s:e], beta[s:e], states[slot], self.shape)
            if out is not None:
                return out
        q, k, v = self._qkv(y)
        rule = gated_delta_rule_step if e - s == 1 else _chunk
        o, new = rule(q, k, v, g[s:e], beta[s:e], states[slot][None])
        states[slot] = new[0]
        return o

    def _qkv(self, x: torch.Tensor):
        kd = self.k_heads * self.k_dim
        q, k, v = x.split([kd, kd, self.v_size], -1)
        rows = x.shape[0]
        q = q.reshape(rows, self.k_heads, self.k_dim)
        k = k.reshape(rows, self.k_heads, self.k_dim)
        if self.tiled:  # value head j reads key head j % k_heads: repeat the key heads whole
            q, k = (t.repeat(1, self.v_heads // self.k_heads, 1) for t in (q, k))
        return q, k, v.reshape(rows, self.v_heads, self.v_dim)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output by the plain weight, times SiLU of its gate z."""
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (self.norm * normed.to(z.dtype)).float()
        gate = F.silu(z.float().reshape(normed.shape))
        return (normed * gate).to(z.dtype).reshape(out.shape[0], self.v_size)


def walk_rows(step: StateStep, tensors, advance, out: torch.Tensor) -> None:
    """Each row of a step from its slot's state: advance(start, end, slot) computes out[start:end]
    (and moves the slot's state past those tokens); a snapshot taken inside a row splits it there,
    every tensor of the slot copied to the snapshot's.
    """
    loc = step.query_start_loc
    for row, slot in enumerate(step.slots.tolist()):
        s, e = loc[row], loc[row + 1]
        for offset, dst in (*step.saves.get(row, ()), (e - s, -1)):
            if s < loc[row] + offset:
                end = loc[row] + offset
                out[s:end] = advance(s, end, slot)
                s = end
            if dst >= 0:
                for t in tensors:
                    t[dst] = t[slot]


def copy_after(step: StateStep, tensors) -> None:
    """The snapshots taken where rows end: each slot's state copied whole."""
    if step.after is not None:
        src, dst = step.after
        for t in tensors:
            t[dst] = t[src]


def _chunk(q, k, v, g, beta, state):
    """chunk_gated_delta_rule with the one-row batch dimension the step form has."""
    out, new = chunk_gated_delta_rule(q, k, v, g, beta, state[0])
    return out, new[None]
