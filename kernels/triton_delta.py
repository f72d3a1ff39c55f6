"""Gated DeltaNet's decode in Triton, one launch a stage: the conv step, the delta-rule step (the
state's tile read and written once in its slot) and the gated norm. kernels/delta_rule.py is the
definition, the native library's delta_net_decode the signature; prompts keep the torch chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def conv_step_kernel(
    x_ptr,
    x_stride,
    states_ptr,
    slots_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    C,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """One row's block of channels: SiLU of the conv over the slot's inputs (plus the bias, where
    it has one: Mamba2's); the slot moves on by one.
    """
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    st = states_ptr + slot * (K - 1) * C
    x = tl.load(x_ptr + r * x_stride + c, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    for t in tl.static_range(K - 1):
        prev = tl.load(st + t * C + c, mask=mask, other=0.0).to(tl.float32)
        acc += prev * tl.load(w_ptr + c * K + t, mask=mask, other=0.0).to(tl.float32)
        if t > 0:
            tl.store(st + (t - 1) * C + c, prev.to(states_ptr.dtype.element_ty), mask=mask)
    tl.store(st + (K - 2) * C + c, x.to(states_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * C + c, acc / (1.0 + tl.exp(-acc)), mask=mask)


@triton.jit
def _delta_step_kernel(
    x_ptr,
    x_stride,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    scale,
    K_HEADS: tl.constexpr,
    V_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TILED: tl.constexpr,
):
    """Row program_id(0), value head program_id(1), value columns of block program_id(2)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if TILED:
        kh = h % K_HEADS
    else:
        kh = h // (V_HEADS // K_HEADS)
    i = tl.arange(0, BK)
    j = tl.program_id(2) * BV + tl.arange(0, BV)
    mi, mj = i < DK, j < DV
    row = x_ptr + r * x_stride
    q = tl.load(row + kh * DK + i, mask=mi, other=0.0).to(tl.float32)
    k = tl.load(row + (K_HEADS + kh) * DK + i, mask=mi, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * K_HEADS * DK + h * DV + j, mask=mj, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay = tl.exp(tl.load(g_ptr + r * V_HEADS + h))
    b = tl.load(beta_ptr + r * V_HEADS + h)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    tile = state_ptr + (slot * V_HEADS + h) * DK * DV + i[:, None] * DV + j[None, :]
    m = mi[:, None] & mj[None, :]
    s = tl.load(tile, mask=m, other=0.0) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * b
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=m)
    tl.store(out_ptr + (r * V_HEADS + h) * DV + j, tl.sum(s * q[:, None], axis=0), mask=mj)


@triton.jit
def _gated_norm_kernel(
    o_ptr, z_ptr, z_stride, w_ptr, out_ptr, heads, dim, eps, BLOCK: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK)
    mask = j < dim
    x = tl.load(o_ptr + (r * heads + h) * dim + j, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    z = tl.load(z_ptr + r * z_stride + h * dim + j, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + j, mask=mask, other=0.0).to(tl.float32)
    y = w * (x * inv) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + (r * heads + h) * dim + j, y.to(out_ptr.dtype.element_ty), mask=mask)


def conv_step(x, conv_states, slots, conv, bias=None) -> torch.Tensor:
    """x [rows, channels] -> SiLU(conv + bias) [rows, channels] fp32; each row's slot of
    conv_states [slots, K-1, channels] moves on by one."""
    rows, channels = x.shape
    y = torch.empty(rows, channels, dtype=torch.float32, device=x.device)
    block = 256
    conv_step_kernel[(rows, triton.cdiv(channels, block))](
        x,
        x.stride(0),
        conv_states,
        slots,
        conv,
        conv if bias is None else bias,
        y,
        channels,
        conv.shape[1],
        block,
        bias is not None,
    )
    return y


def delta_net_decode(x, z, g, beta, conv_states, states, slots, conv, norm, layer):
    """As kernels/cpu_attention.py's; None where the layout is unsupported (fp32 state, unit
    strides).
    """
    k_heads, v_heads, dk, dv, tiled, eps = layer
    rows, channels = x.shape
    if not (
        states.dtype == torch.float32
        and states.is_contiguous()
        and conv_states.is_contiguous()
        and x.stride(1) == 1
        and z.stride(1) == 1
        and conv.is_contiguous()
        and tuple(states.shape[1:]) == (v_heads, dk, dv)
        and v_heads % k_heads == 0
    ):
        return None
    slots = slots.to(torch.int64).contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    y = conv_step(x, conv_states, slots, conv)
    o = torch.empty(rows, v_heads, dv, dtype=torch.float32, device=x.device)
    bk, bv = triton.next_power_of_2(dk), min(32, triton.next_power_of_2(dv))
    _delta_step_kernel[(rows, v_heads, triton.cdiv(dv, bv))](
        y, y.stride(0), g, beta, states, slots, o, dk**-0.5, k_heads, v_heads, dk, dv, bk, bv, tiled
    )
    out = torch.empty(rows, v_heads * dv, dtype=z.dtype, device=x.device)
    _gated_norm_kernel[(rows, v_heads)](
        o, z, z.stride(0), norm, out, v_heads, dv, eps, triton.next_power_of_2(dv)
    )
    return out
