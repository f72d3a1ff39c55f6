"""Top-p without sorting or host sync, for the GPU sampler; kernels/reference.py's top_p_floor_torch
is the same search in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import HALVINGS  # one number for both searches


@triton.jit
def _top_p_floor_kernel(
    probs_ptr, top_p_ptr, floor_ptr, vocab, stride, HALVINGS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * stride
    target = tl.load(top_p_ptr + row)
    top = 0.0
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.max(tl.load(base + cols, mask=cols < vocab, other=0.0), 0))
    lo = tl.full([], 0, tl.int32)  # mass above 0 is everything: >= target
    hi = top.to(tl.int32, bitcast=True)  # mass above the largest is 0: < target
    for _ in tl.static_range(HALVINGS):
        mid = lo + (hi - lo) // 2
        t = mid.to(tl.float32, bitcast=True)
        mass = 0.0
        for v0 in range(0, vocab, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            p = tl.load(base + cols, mask=cols < vocab, other=0.0)
            mass += tl.sum(tl.where(p > t, p, 0.0), 0)
        below = mass < target
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    floor = tl.where(target < 1.0, hi.to(tl.float32, bitcast=True), 0.0)
    tl.store(floor_ptr + row, floor)


def top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest kept probability under top_p, by bisection on float32 bits."""
    rows, vocab = probs.shape
    floor = torch.empty(rows, dtype=torch.float32, device=probs.device)
    if rows:
        probs = probs.contiguous()
        block = 4096 if probs.is_cuda else min(1024, triton.next_power_of_2(vocab))
        _top_p_floor_kernel[(rows,)](
            probs,
            top_p.contiguous(),
            floor,
            vocab,
            probs.stride(0),
            HALVINGS=HALVINGS,
            BLOCK=block,
            num_warps=8 if probs.is_cuda else 4,
        )
    return floor


def launch_cases() -> list[dict]:
    """The top-p kernel as the sampler launches it on a GPU, for kernels/compile_report.py."""
    return [
        dict(
            name="top_p_floor",
            fn=_top_p_floor_kernel,
            signature=dict(
                probs_ptr="*fp32", top_p_ptr="*fp32", floor_ptr="*fp32", vocab="i32", stride="i32"
            ),
            constexprs=dict(HALVINGS=HALVINGS, BLOCK=4096),
            aligned=("probs_ptr", "top_p_ptr", "floor_ptr"),
            num_warps=8,
            num_stages=3,
        )
    ]
