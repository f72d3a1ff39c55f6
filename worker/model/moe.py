"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each a SwiGLU
MLP, routed as transformers routes; the experts run grouped, so a step reads each chosen expert's weights
once and an expert nobody chose not at all (a loop over the chosen experts on a CPU, two grouped-matmul
launches on CUDA: kernels/triton_moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.parallel import Shard


class MoE(nn.Module):
    """Routing is transformers': router logits in the activations' dtype, softmax in fp32, the k largest
    probabilities (renormalized to sum to 1 where the config says norm_topk_prob, always for Mixtral),
    cast back. On a CPU the chosen experts run in expert order, as transformers adds them up.

    Under tensor parallelism every rank holds a slice of every expert's intermediate dimension (as a dense
    MLP is split) and the router whole: ranks route identically, each computes its slice's partial down
    projections, and the layer's all-reduce after the MLP sums them."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, shard.expert_intermediate_size
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))  # gate rows, then up rows
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))
        # "triton" or "torch", chosen at the first forward (where the weights are)
        self.backend: str | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (weights [T, k] in h's dtype, expert ids [T, k] int64)."""
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def forward(self, h: torch.Tensor, ops) -> torch.Tensor:
        """h [T, hidden] (the post-attention norm's output) -> this rank's share of the MLP output [T,
        hidden]."""
        weights, ids = self.route(h)
        if self.backend is None:
            self.backend = default_backend(h.device)
        if self.backend == "triton":
            from kernels.triton_moe import fused_moe

            return fused_moe(h, weights, ids, self.gate_up, self.down, ops.silu_mul)
        return grouped_experts(h, weights, ids, self.gate_up, self.down, ops.silu_mul)


def default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import kernels.triton_moe  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, silu_mul) -> torch.Tensor:
    """The experts as one matmul pair per chosen expert, over the tokens routed to it; each token's share
    added in expert order. weights, ids [T, k]; gate_up [E, 2I, H]; down [E, H, I]."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // top_k
    weight_of = weights.reshape(-1)[order]
    out = torch.zeros_like(h)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = token_of[start : start + count]
        act = silu_mul(F.linear(h[rows], gate_up[expert]).contiguous())
        y = F.linear(act, down[expert]) * weight_of[start : start + count, None]
        out.index_add_(0, rows, y)
        start += count
    return out
