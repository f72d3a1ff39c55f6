"""Gemma 4's pieces beside the common layer: per-layer token embeddings (a second, narrow embedding
of every token for every layer, mixed with a projection of the first), each layer's gated use of
its slice and learned output scalar, and experts routed from the residual stream beside the dense
MLP, each branch with its own norms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.elementwise import rms_norm
from worker.model.moe import MoE
from worker.model.parallel import Collectives, Shard


class PerLayerInputs(nn.Module):
    """Each token's input to every layer, [tokens, layers, width]: (its row of the per-layer table
    scaled by sqrt(width) + the RMS-normed projection of its embedding scaled by hidden^-1/2) / √2.
    Every rank holds the whole of it (it is narrow).
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.layers, self.width = c.num_layers, c.per_layer_input_size
        self.table = nn.Parameter(torch.empty(c.per_layer_vocab, self.layers * self.width))
        self.projection = nn.Parameter(torch.empty(self.layers * self.width, c.hidden_size))
        self.norm = nn.Parameter(torch.ones(self.width))
        self.eps = c.rms_norm_eps
        self.table_scale = math.sqrt(self.width)
        self.projection_scale = c.hidden_size**-0.5

    def forward(self, token_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        # ids past the per-layer vocabulary (none in released models) read nothing, as padding
        inside = token_ids < self.table.shape[0]
        rows = F.embedding(torch.where(inside, token_ids, 0), self.table) * inside[:, None]
        rows = (rows * torch.tensor(self.table_scale, dtype=rows.dtype)).view(
            -1, self.layers, self.width
        )
        mixed = F.linear(embedded, self.projection) * self.projection_scale
        mixed = rms_norm(mixed.view(-1, self.layers, self.width), self.norm, self.eps)
        return (mixed + rows.to(mixed.dtype)) * 2.0**-0.5


class LayerOutput(nn.Module):
    """A layer's last stage: its per-layer input gated in (GELU(gate(x)) * input, projected back,
    normed, added), then the whole stream times the layer's learned scalar.
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        width = c.per_layer_input_size
        self.gate = nn.Parameter(torch.empty(width, c.hidden_size)) if width else None
        self.projection = nn.Parameter(torch.empty(c.hidden_size, width)) if width else None
        self.norm = nn.Parameter(torch.ones(c.hidden_size)) if width else None
        self.scalar = nn.Parameter(torch.ones(1))
        self.eps = c.rms_norm_eps

    def forward(self, x: torch.Tensor, layer_input: torch.Tensor | None) -> torch.Tensor:
        if self.gate is not None:
            g = F.gelu(F.linear(x, self.gate), approximate="tanh") * layer_input.to(x.dtype)
            x = x + rms_norm(F.linear(g, self.projection), self.norm, self.eps)
        return x * self.scalar.to(x.dtype)


class ExpertsBeside(nn.Module):
    """Experts beside the dense MLP: routed from the residual stream (RMS-normed, times a learned
    scale and hidden^-1/2; softmax, top-k renormalized, times each expert's learned scale), fed
    its own norm of the stream; the MLP's output and theirs each normed, then summed.
    """

    def __init__(self, c: ModelConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.moe = MoE(c, shard)
        self.router_norm = nn.Parameter(torch.ones(c.hidden_size))  # scale * hidden^-1/2
        self.expert_scale = nn.Parameter(torch.ones(c.num_experts))
        self.mlp_out_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.in_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.out_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.eps, self.comm = c.rms_norm_eps, comm

    def forward(self, mlp_out: torch.Tensor, stream: torch.Tensor, ops) -> torch.Tensor:
        """mlp_out: the dense MLP's output summed over ranks; stream: the residual stream."""
        route_from = rms_norm(stream, self.router_norm, self.eps)
        weights, ids = self.moe.route(route_from)
        weights = weights * self.expert_scale[ids].to(weights.dtype)
        experts = self.moe(rms_norm(stream, self.in_norm, self.eps), ops, (weights, ids))
        experts = self.comm.all_reduce(experts)
        return rms_norm(mlp_out, self.mlp_out_norm, self.eps) + rms_norm(
            experts, self.out_norm, self.eps
        )
