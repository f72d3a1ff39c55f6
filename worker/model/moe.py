"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral), routed as transformers routes; each chosen
expert's weights are read once a step, the others never (kernels/triton_moe.py on CUDA).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.elementwise import gelu_tanh_mul
from worker.model.parallel import Shard


class MoE(nn.Module):
    """transformers' routing (fp32 softmax, top-k); under TP each rank holds a slice of every
    expert.
    """

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        experts, hidden, inter = (
            config.num_experts,
            config.hidden_size,
            shard.expert_intermediate_size,
        )
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(experts, hidden))
        # gate rows, then up rows (Nemotron-H's: up rows only, relu² between)
        self.gated = config.gated_mlp
        rows = 2 * inter if self.gated else inter
        self.gate_up = nn.Parameter(torch.empty(experts, rows, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))
        # gpt-oss: biases on the router and on every expert's projections (down's on one rank only,
        # since the ranks' shares are summed), and its clamped SwiGLU
        bias = config.expert_bias
        self.router_bias = nn.Parameter(torch.zeros(experts)) if bias else None
        # MiniMax-M2: added to the sigmoid scores to choose, not to weigh
        self.sigmoid = config.sigmoid_router
        correction = self.sigmoid and config.router_correction
        self.correction = nn.Parameter(torch.zeros(experts)) if correction else None
        self.norm_eps = config.router_norm_eps
        # Nemotron-H: chosen within the groups of experts whose two best scores sum highest, the
        # weights scaled
        self.groups, self.topk_groups = config.router_groups, config.router_topk_groups
        self.scale = config.routed_scale
        self.gate_up_bias = nn.Parameter(torch.zeros(experts, 2 * inter)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(experts, hidden)) if bias else None
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.geglu = config.hidden_act == "gelu_tanh"  # Gemma 4's experts
        # "triton" or "torch", chosen at the first forward (where the weights are)
        self.backend: str | None = None
        # the experts on their GGUF blocks, multiplied by `mm` (or in one native call), in place of
        # gate_up/down
        self.blocks = self.mm = self.native = None

    def use_blocks(self, blocks, mm) -> None:
        """Serve the experts on their blocks (a QuantizedMatmul's kernels), never dense."""
        self.blocks, self.mm = blocks, mm
        serves = not self.geglu and NativeExperts.serves(blocks, mm)
        self.native = NativeExperts(self, blocks, mm) if serves else None
        self.gate_up.data = torch.empty(0, dtype=self.gate_up.dtype)
        self.down.data = torch.empty(0, dtype=self.down.dtype)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (weights [T, k] in h's dtype, expert ids [T, k] int64)."""
        logits = F.linear(h, self.router, self.router_bias)
        if self.sigmoid:
            probs = torch.sigmoid(logits.float())
            scores = probs if self.correction is None else probs + self.correction.float()
            ids = torch.topk(self._within_groups(scores), self.top_k)[1]
            weights = probs.gather(1, ids)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(h.dtype), ids

    def _within_groups(self, scores: torch.Tensor) -> torch.Tensor:
        """scores outside the best topk_groups groups masked to -inf (every one with one group)."""
        if self.groups <= 1:
            return scores
        grouped = scores.view(scores.shape[0], self.groups, -1)
        best = torch.topk(grouped.topk(2, dim=-1)[0].sum(-1), self.topk_groups, dim=-1)[1]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)

    def forward(self, h: torch.Tensor, ops, routed=None) -> torch.Tensor:
        """h [T, hidden] -> this rank's share of the MLP output; routed: (weights, ids) chosen
        elsewhere (Gemma 4 routes from the residual stream), else routed from h.
        """
        weights, ids = routed or self.route(h)
        if self.backend is None:
            self.backend = default_backend(h.device)
        act = ops.silu_mul if not self.limit else partial(clamped_swiglu, self.limit, self.alpha)
        act = gelu_tanh_mul if self.geglu else act
        act = act if self.gated else relu_squared
        biases = (self.gate_up_bias, self.down_bias)
        if self.native is not None and h.shape[0] <= self.mm.max_kernel_rows:
            return self.native(h, weights, ids)
        if self.blocks is not None:
            b = self.blocks
            return grouped_experts(h, weights, ids, b.gate_up, b.down, act, *biases, self.mm)
        if self.backend == "triton":
            from kernels.triton_moe import fused_moe

            return fused_moe(h, weights, ids, self.gate_up, self.down, act, *biases)
        return grouped_experts(h, weights, ids, self.gate_up, self.down, act, *biases)

    def fused_refusal(self) -> str | None:
        """Why the fused step cannot run these experts (None: it can)."""
        if self.geglu or self.groups > 64:
            return "experts with a GELU activation, or past 64 groups"
        if self.blocks is not None and self.native is None:
            return "experts on blocks the native experts kernel does not read"
        if self.blocks is None and not all(
            w.dtype == torch.float32 and w.dim() == 3 and w.is_contiguous()
            for w in (self.gate_up, self.down)
        ):
            return "experts neither on GGUF blocks nor plain fp32"
        return None

    def described(self, keep: list):
        """A PsExperts: these experts as the fused step (decode_step.c) routes and runs them; keep:
        what it points into.
        """
        from kernels.cpu_step import PsExperts

        if self.native is not None:
            gate_up, down, types = self.native.experts
            inter = self.native.inter
        else:  # plain fp32 rows (type 0), an expert's at a time
            gate_up = torch.tensor([w.data_ptr() for w in self.gate_up], dtype=torch.int64)
            down = torch.tensor([w.data_ptr() for w in self.down], dtype=torch.int64)
            types, inter = torch.zeros(2, dtype=torch.int32), self.down.shape[2]
        router, bias, gate_up_bias, down_bias = (
            None if t is None else t.detach().float().contiguous()
            for t in (self.router, self.router_bias, self.gate_up_bias, self.down_bias)
        )
        keep.extend((gate_up, down, router, self.correction, bias, gate_up_bias, down_bias))
        return PsExperts(
            router=router.data_ptr(),
            correction=_address(self.correction),
            router_bias=_address(bias),
            gate_up=gate_up.data_ptr(),
            down=down.data_ptr(),
            gate_up_bias=_address(gate_up_bias),
            down_bias=_address(down_bias),
            gate_up_type=int(types[0]),
            down_type=int(types[1]),
            experts=router.shape[0],
            top_k=self.top_k,
            inter=inter,
            sigmoid=int(self.sigmoid),
            normalize=int(self.normalize),
            relu2=int(not self.gated),
            groups=self.groups,
            topk_groups=self.topk_groups,
            norm_eps=self.norm_eps,
            scale=self.scale,
            limit=float(self.limit or 0.0),
            alpha=float(self.alpha or 0.0),
        )


class NativeExperts:
    """The experts on their blocks in one native call a layer (kernels/cpu/quant_matmul.c
    pagedserve_moe_experts): grouped_experts' arithmetic over `mm`'s kernels, in one parallel
    region instead of four calls and a dozen torch ops an expert.
    """

    def __init__(self, moe: MoE, blocks, mm) -> None:
        self.moe, self.blocks, self.mm = moe, blocks, mm  # blocks: the addresses' owners
        self.experts = (
            torch.tensor([w.data.data_ptr() for w in blocks.gate_up], dtype=torch.int64),
            torch.tensor([w.data.data_ptr() for w in blocks.down], dtype=torch.int64),
            torch.tensor([blocks.gate_up[0].type_id, blocks.down[0].type_id], dtype=torch.int32),
        )
        self.inter = blocks.down[0].in_dim
        self.biases = None  # fp32 copies, made at the first forward (after loading)

    @staticmethod
    def serves(blocks, mm) -> bool:
        """Whether the call computes what mm would: one block type each, the kernels' arithmetic
        (packed, or fp32 dot products; not the unpacked int8 kernel).
        """
        from worker.model.quant_weights import QuantWeight
        from worker.model.quantized import INT8_TYPES

        weights = blocks.gate_up + blocks.down
        if not hasattr(getattr(mm, "kernels", None), "moe_experts") or not all(
            isinstance(w, QuantWeight) for w in weights
        ):
            return False
        kinds = {w.qtype for w in blocks.gate_up}, {w.qtype for w in blocks.down}
        if len(kinds[0]) != 1 or len(kinds[1]) != 1:
            return False
        q8act = mm.int8_activations and not mm.packing  # the unpacked int8 kernel: mm's own
        return not (q8act and (kinds[0] | kinds[1]) & set(INT8_TYPES))

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        m = self.moe
        if self.biases is None:
            self.biases = tuple(
                None if b is None else b.detach().float().contiguous()
                for b in (m.gate_up_bias, m.down_bias)
            )
        x = h if h.dtype == torch.float32 and h.is_contiguous() else h.float().contiguous()
        out = torch.empty_like(x)
        act = (float(m.limit or 0.0), float(m.alpha or 0.0), not m.gated)
        w = weights.float().contiguous()
        kernels, bits8 = self.mm.kernels, self.mm.int8_activations
        kernels.moe_experts(
            x, ids.contiguous(), w, self.experts, self.biases, self.inter, act, bits8, out
        )
        return out.to(h.dtype)


def clamped_swiglu(limit: float, alpha: float, gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate at most `limit`, up within it."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


def default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import kernels.triton_moe  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's activation, between an MLP's up and down (no gate)."""
    return torch.relu(x).square()


def grouped_experts(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    mm=None,
) -> torch.Tensor:
    """One matmul pair per chosen expert, shares added in expert order; `mm`: the experts are
    lists of blocks that library multiplies (F.linear's arguments otherwise).
    """
    linear = F.linear if mm is None else mm
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    token_of = order // top_k
    weight_of = weights.reshape(-1)[order]
    out = torch.zeros_like(h)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = token_of[start : start + count]
        gu_bias = None if gate_up_bias is None else gate_up_bias[expert]
        a = act(linear(h[rows], gate_up[expert], gu_bias).contiguous())
        d_bias = None if down_bias is None else down_bias[expert]
        y = linear(a, down[expert], d_bias) * weight_of[start : start + count, None]
        out.index_add_(0, rows, y)
        start += count
    return out


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
