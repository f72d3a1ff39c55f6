"""Multi-adapter LoRA (BGMV) in two Triton launches: shrink t = x @ A[g]^T, then expand into each
token's output span; adapters stacked and zero-padded to the largest rank. worker/model/lora.py is
the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr,
    x_stride,
    a_ptr,
    index_ptr,
    t_ptr,
    in_dim,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # a base row's values go unused (span 0)
    g = tl.maximum(tl.load(index_ptr + token).to(tl.int64), 0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    a_base = a_ptr + g * rank * in_dim
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_dim
        x = tl.load(x_ptr + token * x_stride + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + r[:, None] * in_dim + k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + token * rank + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    t_ptr,
    b_ptr,
    lo_ptr,
    span_ptr,
    index_ptr,
    y_ptr,
    y_stride,
    span_max,
    rank,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    g = tl.load(index_ptr + token).to(tl.int64)
    gs = tl.maximum(g, 0)
    lo = tl.load(lo_ptr + gs).to(tl.int64)
    span = tl.where(g >= 0, tl.load(span_ptr + gs), 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < span
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    t = tl.load(t_ptr + token * rank + r, mask=r_mask, other=0.0)
    b = tl.load(
        b_ptr + gs * span_max * rank + n[:, None] * rank + r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1)
    y = y_ptr + token * y_stride + lo + n
    old = tl.load(y, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y, (old + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


SHRINK_BLOCK_K, EXPAND_BLOCK_N = 128, 64


def launch_cases(dtype: str = "bf16") -> list[dict]:
    """Both kernels at an 8B shape with rank-16 adapters, for compile_report."""
    ptr = f"*{dtype}"
    cases = []
    for rank in (16, 48):
        cases.append(
            dict(
                name=f"lora shrink r{rank}",
                fn=_shrink_kernel,
                signature=dict(
                    x_ptr=ptr,
                    x_stride="i32",
                    a_ptr=ptr,
                    index_ptr="*i32",
                    t_ptr="*fp32",
                    in_dim="i32",
                    rank="i32",
                ),
                constexprs=dict(
                    BLOCK_R=min(triton.next_power_of_2(rank), 32), BLOCK_K=SHRINK_BLOCK_K
                ),
                aligned=("x_ptr", "a_ptr", "t_ptr", "in_dim"),
                num_warps=4,
                num_stages=3,
            )
        )
        cases.append(
            dict(
                name=f"lora expand r{rank}",
                fn=_expand_kernel,
                signature=dict(
                    t_ptr="*fp32",
                    b_ptr=ptr,
                    lo_ptr="*i32",
                    span_ptr="*i32",
                    index_ptr="*i32",
                    y_ptr=ptr,
                    y_stride="i32",
                    span_max="i32",
                    rank="i32",
                ),
                constexprs=dict(BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=triton.next_power_of_2(rank)),
                aligned=("t_ptr", "b_ptr", "y_ptr"),
                num_warps=4,
                num_stages=3,
            )
        )
    return cases


def lora_update(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lo: torch.Tensor,
    span: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[i, lo[g]:lo[g] + span[g]] += (x[i] @ a[g]^T) @ b[g, :span[g]]^T (g: i's adapter)."""
    tokens, in_dim = x.shape
    groups, rank, _ = a.shape
    span_max = b.shape[1]
    if tokens == 0 or groups == 0 or rank == 0:
        return out
    if x.stride(1) != 1 or out.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora_update needs unit column strides and contiguous stacks")
    t = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 32)
    _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, x.stride(0), a, index, t, in_dim, rank, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K
    )
    block_n = EXPAND_BLOCK_N
    _expand_kernel[(tokens, triton.cdiv(span_max, block_n))](
        t,
        b,
        lo,
        span,
        index,
        out,
        out.stride(0),
        span_max,
        rank,
        BLOCK_N=block_n,
        BLOCK_R=triton.next_power_of_2(rank),
    )
    return out
