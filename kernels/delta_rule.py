"""The recurrent layers' pieces in plain fp32 torch: the causal conv; Gated DeltaNet's gated delta
rule, chunked (WY form) and one step at a time; Mamba2's state-space scan (SSD), chunked and one
step at a time. The definition the native and Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, silu: bool = True, bias=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] after `state` [K-1, C], conv [C, K] (+ bias [C]) and SiLU (or none) -> (out [T, C],
    state).
    """
    width, tokens = weight.shape[1], x.shape[0]
    xs = torch.cat([state.to(x.dtype), x])  # [T + K - 1, C]
    taps = weight.t().contiguous()  # [K, C]: each tap's weights contiguous, accumulated in place
    out = xs[:tokens] * taps[0]
    for j in range(1, width):
        out.addcmul_(xs[j : j + tokens], taps[j])
    if bias is not None:
        out += bias
    return F.silu(out, inplace=True) if silu else out, xs[xs.shape[0] - (width - 1) :]


def causal_conv_step(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, silu: bool = True, bias=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C], states [R, K-1, C] -> (out [R, C], new states)."""
    xs = torch.cat([states.to(x.dtype), x[:, None, :]], dim=1)  # [R, K, C]
    out = (xs * weight.t()[None]).sum(1)
    if bias is not None:
        out = out + bias
    return F.silu(out) if silu else out, xs[:, 1:]


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [R, Hk, Dk], v [R, Hv, Dv], g, beta [R, Hv], state [R, Hv, Dk, Dv] -> (out, state)."""
    q, k = _heads(q, k, v.shape[-2])
    s = state * g.float().exp()[..., None, None]
    delta = (v.float() - torch.einsum("rhkv,rhk->rhv", s, k)) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("rhkv,rhk->rhv", s, q), s


def _heads(q: torch.Tensor, k: torch.Tensor, heads_v: int):
    """q, k in fp32, L2-normalized (q scaled), repeated over their value heads."""
    q, k = _l2(q.float()) * q.shape[-1] ** -0.5, _l2(k.float())
    if q.shape[-2] != heads_v:
        rep = heads_v // q.shape[-2]
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] -> (out, state); chunks
    folded by two triangular solves (WY form), run in order.
    """
    length = q.shape[0]
    q, k = _heads(q, k, v.shape[-2])
    pad = (-length) % chunk
    # [H, N, C, D]: padded tokens have k = 0 and g = 0, so they change nothing
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, chunk), beta.reshape(heads, -1, chunk)
    gc = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is taken as 1
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True
    )
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_decayed = k * (gc[..., -1:] - gc).exp()[..., None]
    last = gc[..., -1].exp()
    out = torch.empty_like(v)
    s = state.float()
    for n in range(q.shape[1]):
        fresh = u[:, n] - w[:, n] @ s
        out[:, n] = q_decayed[:, n] @ s + inner[:, n] @ fresh
        s = s * last[:, n, None, None] + k_decayed[:, n].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), s


def ssd_step(x, dt, a, b, c, state):
    """Mamba2, one token a row: x [R, H, P], dt [R, H] (after softplus), a [H] (negative), b, c
    [R, G, N], state [R, H, P, N] fp32 -> (y [R, H, P] without the D skip, new state).
    """
    heads = x.shape[1]
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1)  # [R, H, N]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1)
    decay = torch.exp(dt * a)[..., None, None]
    s = state * decay + (dt[..., None] * x.float())[..., None] * b[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", s, c), s


def ssd_chunked(x, dt, a, b, c, state, chunk: int = 64):
    """Mamba2 over one sequence's tokens in chunks: x [T, H, P], dt [T, H], a [H], b, c [T, G, N],
    state [H, P, N] fp32 -> (y [T, H, P] without the D skip, final state). Within a chunk each
    token reads every earlier one through the decays between them; across chunks, the state.
    """
    tokens, heads = x.shape[:2]
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1).transpose(0, 1)  # [H, T, N]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1).transpose(0, 1)
    xdt = (x.float() * dt[..., None]).transpose(0, 1)  # [H, T, P]
    log_decay = (dt * a).transpose(0, 1)  # [H, T]
    y = torch.empty(heads, tokens, x.shape[2], dtype=torch.float32, device=x.device)
    for s in range(0, tokens, chunk):
        e = min(s + chunk, tokens)
        cum = torch.cumsum(log_decay[:, s:e], dim=1)  # [H, L]
        gaps = cum[:, :, None] - cum[:, None, :]  # [H, L (to), L (from)]
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(gaps.masked_fill(~causal, float("-inf"))) * (c[:, s:e] @ b[:, s:e].mT)
        y[:, s:e] = weights @ xdt[:, s:e] + torch.exp(cum)[..., None] * (c[:, s:e] @ state.mT)
        to_end = torch.exp(cum[:, -1:] - cum)  # [H, L]
        state = state * torch.exp(cum[:, -1])[:, None, None] + torch.einsum(
            "hl,hlp,hln->hpn", to_end, xdt[:, s:e], b[:, s:e]
        )
    return y.transpose(0, 1), state
