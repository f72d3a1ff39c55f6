"""Mamba2's decode in Triton, one launch a stage: the conv step (with its bias; Gated DeltaNet's
kernel) and the state-space step, each head's [head_dim, d_state] tile of the slot's state read and
written once. kernels/delta_rule.py's ssd_step is the definition; prompts keep the torch chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_delta import conv_step


@triton.jit
def _ssd_step_kernel(
    xbc_ptr,
    dt_ptr,
    a_ptr,
    d_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """One row's head, a block of its values: the state decayed by exp(dt * a), plus dt * x * B;
    y = state . C + D * x."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    pm, nm = p < P, n < N
    inner = HEADS * P
    row = xbc_ptr + r * (inner + 2 * GROUPS * N)
    group = h // (HEADS // GROUPS)
    x = tl.load(row + h * P + p, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(row + inner + group * N + n, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(row + inner + (GROUPS + group) * N + n, mask=nm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + r * HEADS + h)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    slot = tl.load(slots_ptr + r).to(tl.int64)
    tile = state_ptr + ((slot * HEADS + h) * P + p[:, None]) * N + n[None, :]
    mask = pm[:, None] & nm[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * decay + (dt * x)[:, None] * b[None, :]
    tl.store(tile, s, mask=mask)
    y = tl.sum(s * c[None, :], axis=1) + tl.load(d_ptr + h) * x
    tl.store(out_ptr + r * inner + h * P + p, y, mask=pm)


def mamba_decode(xbc, dt, a, d, conv_states, ssm_states, slots, conv, conv_bias, layer):
    """xbc [rows, conv channels] (before the conv), dt [rows, heads] (after softplus), a and d
    [heads] -> y [rows, heads * head_dim] fp32, the D skip added; each row's conv and state slots
    advance in place. None where the layout is not taken (fp32 state, unit strides).
    """
    heads, head_dim, groups, d_state = layer
    rows, channels = xbc.shape
    if not (
        ssm_states.dtype == torch.float32
        and ssm_states.is_contiguous()
        and conv_states.is_contiguous()
        and xbc.stride(1) == 1
        and conv.is_contiguous()
        and tuple(ssm_states.shape[1:]) == (heads, head_dim, d_state)
        and channels == heads * head_dim + 2 * groups * d_state
    ):
        return None
    slots = slots.to(torch.int64).contiguous()
    y = conv_step(xbc, conv_states, slots, conv, conv_bias)
    out = torch.empty(rows, heads * head_dim, dtype=torch.float32, device=xbc.device)
    bp, bn = min(32, triton.next_power_of_2(head_dim)), triton.next_power_of_2(d_state)
    dt, a, d = dt.float().contiguous(), a.float().contiguous(), d.float().contiguous()
    _ssd_step_kernel[(rows, heads, triton.cdiv(head_dim, bp))](
        y, dt, a, d, ssm_states, slots, out, heads, groups, head_dim, d_state, bp, bn
    )
    return out


def launch_cases() -> list[dict]:
    """The conv step (with a bias) and the SSD step at Nemotron-H-8B's Mamba2 shapes (128 heads of
    64, 8 groups of state 128), for compile_report."""
    from kernels.triton_delta import conv_step_kernel

    heads, head_dim, groups, d_state = 128, 64, 8, 128
    channels = heads * head_dim + 2 * groups * d_state
    conv = dict(
        name=f"mamba2 conv step c{channels}",
        fn=conv_step_kernel,
        signature=dict(
            x_ptr="*bf16",
            x_stride="i32",
            states_ptr="*bf16",
            slots_ptr="*i64",
            w_ptr="*bf16",
            bias_ptr="*bf16",
            out_ptr="*fp32",
            C="i32",
        ),
        constexprs=dict(K=4, BLOCK=256, HAS_BIAS=True),
    )
    ssd = dict(
        name=f"mamba2 ssd step h{heads} p{head_dim} n{d_state}",
        fn=_ssd_step_kernel,
        signature=dict(
            xbc_ptr="*fp32",
            dt_ptr="*fp32",
            a_ptr="*fp32",
            d_ptr="*fp32",
            state_ptr="*fp32",
            slots_ptr="*i64",
            out_ptr="*fp32",
        ),
        constexprs=dict(HEADS=heads, GROUPS=groups, P=head_dim, N=d_state, BP=32, BN=d_state),
    )
    return [dict(case, num_warps=4, num_stages=1) for case in (conv, ssd)]
