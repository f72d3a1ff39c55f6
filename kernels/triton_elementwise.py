"""A layer's elementwise tail in Triton, one launch each: residual add + RMSNorm, SiLU·mul, RoPE in
place. fp32 arithmetic; worker/model/elementwise.py's TorchOps is the definition they are tested
against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    residual_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    dim,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(residual_ptr + row * dim + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = x.to(tl.float32) + tl.load(delta_ptr + row * dim + cols, mask=mask, other=0.0).to(
            tl.float32
        )
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * dim + cols, x, mask=mask)  # the residual stream, in place
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


# staged per step: see triton_attention
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rope_kernel(
    x_ptr, row_stride, positions_ptr, cos_ptr, sin_ptr, half, head_dim, HALF: tl.constexpr
):
    """Rotate-half RoPE of one token's head, in place, over its first 2 * half values."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    mask = i < half
    pos = tl.load(positions_ptr + token).to(tl.int64)
    c = tl.load(cos_ptr + pos * half + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * half + i, mask=mask, other=0.0)
    base = x_ptr + token * row_stride + head * head_dim
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half + i, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


class TritonElementwise:
    """The launchers, with the signatures of kernels/cpu_native.py's (worker/model/elementwise.py
    drives both)."""

    @staticmethod
    def delta_net_decode(*args):
        """Gated DeltaNet's decode (kernels/triton_delta.py)."""
        from kernels.triton_delta import delta_net_decode

        return delta_net_decode(*args)

    @staticmethod
    def mamba_decode(*args):
        """Mamba2's decode (kernels/triton_ssd.py)."""
        from kernels.triton_ssd import mamba_decode

        return mamba_decode(*args)

    @staticmethod
    def add_rms_norm(
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        """residual += delta in place (when given); out = rms_norm(residual) * weight. Contiguous
        [rows, dim].
        """
        rows, dim = residual.shape
        if rows:
            _add_rms_norm_kernel[(rows,)](
                residual,
                residual if delta is None else delta,
                weight,
                out,
                dim,
                eps,
                HAS_DELTA=delta is not None,
                BLOCK=triton.next_power_of_2(dim),
            )

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate_up[:, :I]) * gate_up[:, I:]; contiguous [rows, 2I] and [rows, I]."""
        rows, width = gate_up.shape
        inter = width // 2
        block = min(1024, triton.next_power_of_2(inter))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)

    @staticmethod
    def rope(
        x: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate-half RoPE in place on the first `heads` heads; cos, sin fp32 [max_pos, rotary_dim
        / 2].
        """
        rows, half = x.shape[0], cos.shape[1]
        if rows:
            _rope_kernel[(rows, heads)](
                x,
                x.stride(0),
                positions,
                cos,
                sin,
                half,
                head_dim,
                HALF=triton.next_power_of_2(half),
            )


def launch_cases(head_dims, dtype: str = "bf16") -> list[dict]:
    """The elementwise kernels as launched at hidden 4096,
    MLP 14336, for kernels/compile_report.py.
    """
    ptr = f"*{dtype}"
    hidden, inter = 4096, 14336
    cases = [
        dict(
            name=f"add_rms_norm h{hidden}",
            fn=_add_rms_norm_kernel,
            signature=dict(
                residual_ptr=ptr, delta_ptr=ptr, weight_ptr=ptr, out_ptr=ptr, dim="i32", eps="fp32"
            ),
            constexprs=dict(HAS_DELTA=True, BLOCK=triton.next_power_of_2(hidden)),
            aligned=("residual_ptr", "delta_ptr", "weight_ptr", "out_ptr", "dim"),
            num_warps=4,
            num_stages=3,
        ),
        dict(
            name=f"silu_mul i{inter}",
            fn=_silu_mul_kernel,
            signature=dict(gate_up_ptr=ptr, out_ptr=ptr, inter="i32"),
            constexprs=dict(BLOCK=min(1024, triton.next_power_of_2(inter))),
            aligned=("gate_up_ptr", "out_ptr", "inter"),
            num_warps=4,
            num_stages=3,
        ),
    ]
    for head_dim in head_dims:
        cases.append(
            dict(
                name=f"rope d{head_dim}",
                fn=_rope_kernel,
                signature=dict(
                    x_ptr=ptr,
                    row_stride="i32",
                    positions_ptr="*i64",
                    cos_ptr="*fp32",
                    sin_ptr="*fp32",
                    half="i32",
                    head_dim="i32",
                ),
                constexprs=dict(HALF=triton.next_power_of_2(head_dim // 2)),
                aligned=("x_ptr", "row_stride"),
                num_warps=4,
                num_stages=3,
            )
        )
    return cases
