"""A layer's elementwise tail behind one interface: `TorchOps` (the definition), `NativeOps` (CPU),
`TritonOps` (GPU), and the RoPE tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, over [rows, 2 * I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [tokens, heads, head_dim]; cos, sin [tokens, 1, rotary_dim / 2]: rotate-half over the first
    # rotary_dim values
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class TorchOps:
    name = "torch"

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        bf16_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, its RMSNorm); bf16_out rounds for the next bf16 GEMM."""
        if delta is not None:
            residual = residual + delta.to(residual.dtype)
        out = rms_norm(residual, weight, eps)
        return residual, out.to(torch.bfloat16) if bf16_out else out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def head_norms(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of q and k."""
        return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        """Per-step state shared by every layer."""
        return rotary.lookup(positions, dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (views of one fused row)."""
        return apply_rotary(q, *state), apply_rotary(k, *state)

    def rotate(self, x: torch.Tensor, state) -> torch.Tensor:
        """Rotate one [tokens, heads, head_dim] tensor (queries over another layer's keys)."""
        return apply_rotary(x, *state)


class NativeOps(TorchOps):
    name = "native"

    def __init__(self, kernels) -> None:
        self.k = kernels

    @staticmethod
    def covers(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32

    # the norms take and give bf16 rows around bf16 GEMMs
    mixed_bf16 = True

    def add_rms_norm(self, residual, delta, weight, eps, bf16_out=False):
        if not (
            residual.is_contiguous()
            and (delta is None or delta.is_contiguous())
            and weight.is_contiguous()
        ):
            return super().add_rms_norm(residual, delta, weight, eps, bf16_out)
        if bf16_out or (delta is not None and delta.dtype != residual.dtype):
            if not (
                self.mixed_bf16
                and residual.dtype == torch.float32
                and (delta is None or delta.dtype in (torch.float32, torch.bfloat16))
            ):
                return super().add_rms_norm(residual, delta, weight, eps, bf16_out)
            out = torch.empty_like(residual, dtype=torch.bfloat16 if bf16_out else torch.float32)
            # residual += delta in place
            self.k.add_rms_norm_mixed(residual, delta, weight, out, eps)
            return residual, out
        out = torch.empty_like(residual)
        self.k.add_rms_norm(residual, delta, weight, out, eps)  # residual += delta in place
        return residual, out

    def silu_mul(self, gate_up):
        if not gate_up.is_contiguous() or (
            gate_up.device.type == "cpu" and gate_up.dtype not in (torch.float32, torch.bfloat16)
        ):
            return super().silu_mul(gate_up)
        out = torch.empty(
            gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device
        )
        self.k.silu_mul(gate_up, out)
        return out

    def head_norms(self, q, k, q_weight, k_weight, eps):
        """In place on the fused QKV row."""
        views = all(
            t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            for t in (q, k)
        )
        if not (
            views
            and q_weight.is_contiguous()
            and k_weight.is_contiguous()
            and q_weight.dtype == k_weight.dtype == torch.float32
        ):
            return super().head_norms(q, k, q_weight, k_weight, eps)
        for t, w in ((q, q_weight), (k, k_weight)):
            self.k.head_rms_norm(
                t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1)),
                t.shape[1],
                t.shape[2],
                w,
                eps,
            )
        return q, k

    def rope_tables(self, rotary, positions, dtype):
        return rotary, positions.to(torch.int64).contiguous()

    def rope(self, q, k, state):
        rotary, positions = state
        tokens, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        fused = (
            q.stride(1) == head_dim
            and k.stride(1) == head_dim
            and q.stride(2) == 1
            and k.stride(2) == 1
            and q.stride(0) == k.stride(0)
            and k.data_ptr() == q.data_ptr() + heads * head_dim * q.element_size()
        )
        # q then k heads, adjacent in each row of the fused QKV output: one pass, in place
        if fused:
            rows = q.as_strided((tokens, (heads + kv_heads) * head_dim), (q.stride(0), 1))
            self.k.rope(rows, heads + kv_heads, head_dim, rotary.cos, rotary.sin, positions)
            return q, k
        return self.rotate(q, state), self.rotate(k, state)

    def rotate(self, x, state):
        rotary, positions = state
        x = x.contiguous()
        tokens, heads, head_dim = x.shape
        self.k.rope(x.view(tokens, -1), heads, head_dim, rotary.cos, rotary.sin, positions)
        return x


class TritonOps(NativeOps):
    """The same single passes as Triton kernels, for the GPU."""

    name = "triton"
    head_norms = TorchOps.head_norms
    mixed_bf16 = False

    def __init__(self) -> None:
        from kernels.triton_elementwise import TritonElementwise

        super().__init__(TritonElementwise())


def default_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """Triton on CUDA, native kernels for fp32 on a CPU where they build, torch otherwise."""
    if device.type == "cuda":
        try:
            return TritonOps()
        # the worker said so at start (worker/model/attention.py default_backend_name)
        except ImportError:
            return TorchOps()
    if device.type == "cpu" and dtype == torch.float32:
        from kernels import cpu_native

        kernels = cpu_native.load()
        if kernels is not None:
            return NativeOps(kernels)
    return TorchOps()


class RopeSets(tuple):
    """A step's rotary tables for global and sliding layers, where they differ (Gemma 3)."""


class Rotary:
    """cos/sin tables for every position (rotate-half convention); a step
    looks its tokens up once.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        inv_freq = torch.tensor(config.rope_inv_freq(), dtype=torch.float32, device=device)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim / 2]
        scale = config.rope_attention_factor()  # YaRN scales both (1 elsewhere)
        self.cos, self.sin = freqs.cos() * scale, freqs.sin() * scale

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin of each token, [num_tokens, 1, rotary_dim / 2]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )
