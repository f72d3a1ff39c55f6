"""MoE MLP on the GPU as two grouped Triton matmuls: each chosen expert read once a step, the others
never. worker/model/moe.py's loop is the definition it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    sorted_ptr,
    block_expert_ptr,
    weight_ptr,
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_BY_PAIR: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[pair, n] = a[row(pair)] . w[expert, n] x routing weight, one expert's pairs."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last expert's run: padding
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs
    if A_BY_PAIR:
        row = pair
    else:
        row = pair // top_k
    row = tl.where(valid, row, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )


BLOCK_M = (
    16  # pairs a program takes (tl.dot's smallest); one expert's run is padded to a multiple of it
)


def align(
    expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, runs padded to block_m; shapes depend on T·k and E only: no sync."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    raw_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # pairs by expert, each expert's in token order
    by_expert = flat[order]
    dest = pad_start[by_expert] + torch.arange(pairs, device=device) - raw_start[by_expert]
    # at most min(E, T·k) experts have a run, each padded by under block_m
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _blocks(n: int, k: int) -> tuple[int, int]:
    return max(16, min(64, triton.next_power_of_2(n))), max(16, min(64, triton.next_power_of_2(k)))


def grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    num_pairs: int,
    a_by_pair: bool,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> [num_pairs, N]: each pair's row of `a` times its expert's w [E, N, K]^T, optionally
    scaled.
    """
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    block_n, block_k = _blocks(n, k)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a,
        w,
        out,
        sorted_pairs,
        block_expert,
        weights if weights is not None else out,
        num_pairs,
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_BY_PAIR=a_by_pair,
        MUL_WEIGHT=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] routed to k of E experts -> [T, H], sorted on the device (graph-safe); biases
    (gpt-oss) added per pair by its expert.
    """
    x = x.contiguous()
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    sorted_pairs, block_expert = align(topk_ids, gate_up.shape[0])
    gu = grouped_matmul(x, gate_up, sorted_pairs, block_expert, top_k, pairs, a_by_pair=False)
    if gate_up_bias is not None:
        gu += gate_up_bias[topk_ids.reshape(-1)]
    act = act(gu)
    y = grouped_matmul(
        act,
        down,
        sorted_pairs,
        block_expert,
        top_k,
        pairs,
        a_by_pair=True,
        weights=topk_weights.reshape(-1).contiguous(),
    )
    if down_bias is not None:  # the kernel weighted the product: the bias takes the weight too
        y += down_bias[topk_ids.reshape(-1)] * topk_weights.reshape(-1, 1)
    return y.view(tokens, top_k, -1).sum(1)


def launch_cases(dtype: str = "bf16") -> list[dict]:
    """The grouped matmul at Qwen3-30B-A3B's shapes, gate/up and down, for compile_report."""
    ptr = f"*{dtype}"
    cases = []
    for name, n, k, by_pair in (("gate_up", 2 * 768, 2048, False), ("down", 2048, 768, True)):
        block_n, block_k = _blocks(n, k)
        cases.append(
            dict(
                name=f"moe {name} n{n} k{k}",
                fn=_grouped_matmul_kernel,
                signature=dict(
                    a_ptr=ptr,
                    w_ptr=ptr,
                    c_ptr=ptr,
                    sorted_ptr="*i32",
                    block_expert_ptr="*i32",
                    weight_ptr=ptr,
                    num_pairs="i32",
                    N="i32",
                    K="i32",
                    top_k="i32",
                    stride_am="i32",
                    stride_we="i32",
                    stride_wn="i32",
                    stride_cm="i32",
                ),
                constexprs=dict(
                    A_BY_PAIR=by_pair,
                    MUL_WEIGHT=by_pair,
                    PRECISION="tf32",
                    BLOCK_M=BLOCK_M,
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                ),
                aligned=(
                    "a_ptr",
                    "w_ptr",
                    "c_ptr",
                    "N",
                    "K",
                    "stride_am",
                    "stride_we",
                    "stride_wn",
                    "stride_cm",
                ),
                num_warps=4,
                num_stages=3,
            )
        )
    return cases
