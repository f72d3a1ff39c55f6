"""One decoder layer over the paged KV (or, in a hybrid's linear layers, the state pool): norms,
attention or Gated DeltaNet, and the MLP or experts, projections fused; and a step's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.delta_net import GatedDeltaNet, StateStep
from worker.model.elementwise import RopeSets, TorchOps, gelu_tanh_mul, rms_norm
from worker.model.families import GEMMA4_TYPES
from worker.model.gemma4 import ExpertsBeside, LayerOutput
from worker.model.kv_pool import KVPool
from worker.model.linear import DenseMatmul
from worker.model.lora import StepLora
from worker.model.mamba2 import Mamba2
from worker.model.moe import MoE, relu_squared
from worker.model.parallel import Collectives, Shard
from worker.model.short_conv import ShortConv


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    attn_meta: object  # the backend's per-step metadata (built once, shared by all layers)
    # LoRA adapters' updates of the step's rows (model/lora.py), where any
    lora: StepLora | None = None
    # a hybrid's rows in the recurrent-state pool (model/delta_net.py)
    state: StateStep | None = None
    # Gemma 4: each token's input to every layer, [tokens, layers, width] (model/gemma4.py)
    per_layer: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, shard: Shard, comm: Collectives
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.comm = comm
        self.num_heads = shard.num_q_heads  # this rank's heads
        # this rank's KV heads and the head size (Gemma 4's full layers' differ); a layer that
        # reads another's K/V (Gemma 4) projects none, one whose values are its keys no values
        self.head_dim = c.head_dim_of(layer_idx)
        self.num_kv_heads = (c.kv_shape(layer_idx, shard.size) or (0,))[0]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.values_from_keys = c.values_from_keys and c.global_layer(layer_idx)
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        # a hybrid's linear layer: Gated DeltaNet between in_proj and out_proj, no paged K/V
        linear_heads = (
            shard.linear_k_heads[1] - shard.linear_k_heads[0],
            shard.linear_v_heads[1] - shard.linear_v_heads[0],
        )
        self.linear = GatedDeltaNet(c, *linear_heads) if c.is_linear(layer_idx) else None
        # an LFM's short-conv block: this rank's share of the channels
        channels = c.hidden_size // shard.size
        self.short_conv = ShortConv(channels, c.short_conv_kernel) if c.is_conv(layer_idx) else None
        self.mamba = Mamba2(c, shard.size) if c.is_mamba(layer_idx) else None
        self.qkv = self.qkv_bias = self.q_norm = self.k_norm = self.o_proj = None
        self.o_bias = self.sinks = None
        mixer = self.linear or self.short_conv or self.mamba
        if c.ffn_only(layer_idx):  # Nemotron-H: an MLP or experts alone
            pass
        elif mixer is not None:
            self.in_proj = nn.Parameter(torch.empty(mixer.in_rows, c.hidden_size))
            self.out_proj = nn.Parameter(torch.empty(c.hidden_size, mixer.out_width))
            if c.parallel_mamba:  # Falcon-H1: attention beside it
                self._attention_parameters(c)
        else:
            self._attention_parameters(c)
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))  # before the MLP
        # Gemma's norms of the attention and MLP outputs, before each residual add
        outputs_normed = c.sandwich_norms and (not c.post_norm_layers or c.post_norms(layer_idx))
        self.attn_out_norm = nn.Parameter(torch.ones(c.hidden_size)) if outputs_normed else None
        self.mlp_out_norm = nn.Parameter(torch.ones(c.hidden_size)) if outputs_normed else None
        dense = self._ffn_parameters(c, shard, comm, layer_idx)
        self.output = LayerOutput(c) if c.model_type in GEMMA4_TYPES else None
        names = self.LINEAR_WEIGHTS if mixer is not None else self.MATMUL_WEIGHTS
        names = self.PARALLEL_WEIGHTS if c.parallel_mamba else names
        if c.ffn_only(layer_idx):  # its MLP's, or none beside experts alone
            self.matmul_names = names[2:] if dense else ()
        else:
            self.matmul_names = names if dense else names[:2]
        # kept when released
        self.shapes = {name: tuple(getattr(self, name).shape) for name in self.matmul_names}
        self.config = c
        # the matmul library and the weights in its layout (LlamaModel.use_matmul)
        self.mm = DenseMatmul()
        self.w: dict[str, torch.Tensor] = {}

    def _ffn_parameters(self, c: ModelConfig, shard: Shard, comm, layer_idx: int) -> bool:
        """A dense MLP, or experts beside an optional (sigmoid-gated) shared expert or (Gemma 4)
        beside the MLP; -> whether a dense MLP is there.
        """
        beside = c.moe_beside_mlp and c.is_moe(layer_idx)
        self.beside = ExpertsBeside(c, shard, comm) if beside else None
        self.moe = MoE(c, shard) if c.is_moe(layer_idx) and not beside else None
        dense = not c.mixer_only(layer_idx) and (self.moe is None or c.shared_expert)
        # this rank's share (Gemma 4's layers that read another's K/V may be twice as wide)
        inter = shard.intermediate_size * c.mlp_width(layer_idx) // c.intermediate_size
        rows = (2 if c.gated_mlp else 1) * inter  # gate and up, or up alone
        self.gate_up = nn.Parameter(torch.empty(rows, c.hidden_size)) if dense else None
        self.down = nn.Parameter(torch.empty(c.hidden_size, inter)) if dense else None
        gated = self.moe is not None and c.shared_expert and c.shared_expert_gated
        self.shared_gate = nn.Parameter(torch.empty(1, c.hidden_size)) if gated else None
        return dense

    def _attention_parameters(self, c: ModelConfig) -> None:
        # q, k, v, then (gated attention) one gate a query value, or (LFM) one a head
        values = 0 if self.values_from_keys else self.kv_size
        qkv_rows = self.q_size * (2 if c.attn_output_gate else 1) + self.kv_size + values
        qkv_rows += self.num_heads if c.attn_head_gate else 0
        self.qkv = nn.Parameter(torch.empty(qkv_rows, c.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_rows)) if c.attention_bias else None
        # per head, or (OLMo 3) over this rank's share of the whole projection
        q_dim, k_dim = (self.q_size, self.kv_size) if c.qk_norm_whole else (self.head_dim,) * 2
        self.q_norm = nn.Parameter(torch.ones(q_dim)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(k_dim)) if c.qk_norm and self.kv_size else None
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, self.q_size))
        # gpt-oss: o_proj bias (added once, after the sum over ranks), this rank's sinks
        self.o_bias = nn.Parameter(torch.zeros(c.hidden_size)) if c.o_proj_bias else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if c.attn_sinks else None

    MATMUL_WEIGHTS = ("qkv", "o_proj", "gate_up", "down")
    LINEAR_WEIGHTS = ("in_proj", "out_proj", "gate_up", "down")
    PARALLEL_WEIGHTS = ("qkv", "o_proj", "in_proj", "out_proj", "gate_up", "down")

    def use_matmul(self, lib, drop_dense: bool) -> None:
        self.mm = lib
        self.w = {name: lib.prepare(getattr(self, name)) for name in self.matmul_names}
        # the prepared copy is all the forward reads: give the loaded layout's memory back
        if drop_dense:
            for name in self.matmul_names:
                getattr(self, name).data = torch.empty(0, dtype=getattr(self, name).dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        step: StepInputs,
        pool: KVPool,
        rope,
        attn: AttentionBackend,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add fused with the norm, attention (or a stateful mixer), MLP -> (MLP output,
        residual). A Nemotron-H layer is one of the two halves alone.
        """
        c = self.config
        into_bf16 = self._bf16_between(self.mm, ops, step.lora, x.shape[0])
        if not c.ffn_only(self.layer_idx):
            residual, x = self._mix(x, residual, step, pool, rope, attn, ops, into_bf16)
            if c.mixer_only(self.layer_idx):
                return x, residual
        bf16 = self.moe is None and into_bf16("gate_up")
        if c.post_norms(self.layer_idx):
            residual = h = residual + x
        else:
            residual, h = self._add_norm(residual, x, self.post_attn_norm, ops, bf16)
        if self.moe is None:
            out = self.comm.all_reduce(self._mlp(h, step, ops, into_bf16("down")))
            out = out if self.beside is None else self.beside(out, residual, ops)
        elif self.gate_up is None:
            out = self.comm.all_reduce(self.moe(h, ops))
        elif self.shared_gate is None:  # Granite, Nemotron-H: the shared MLP added as it is
            out = self.comm.all_reduce(self.moe(h, ops) + self._mlp(h, step, ops, False))
        else:
            shared = self._mlp(h, step, ops, False).float()
            scale = torch.sigmoid(F.linear(h, self.shared_gate).float())
            out = self.comm.all_reduce(self.moe(h, ops) + (scale * shared).to(h.dtype))
        if self.mlp_out_norm is not None:
            out = rms_norm(out, self.mlp_out_norm, c.rms_norm_eps)
        if self.output is not None:  # Gemma 4: the stream itself goes on (None: no residual)
            per_layer = None if step.per_layer is None else step.per_layer[:, self.layer_idx]
            return self.output(residual + out, per_layer), None
        return (out * c.residual_scale if c.residual_scale != 1.0 else out), residual

    def _add_norm(self, residual, x, weight, ops, bf16: bool):
        """(residual + x, its RMSNorm); the first layer's residual is x itself."""
        eps = self.config.rms_norm_eps
        if residual is None:
            return ops.add_rms_norm(x, None, weight, eps, bf16)
        return ops.add_rms_norm(residual, x, weight, eps, bf16)

    def _mix(self, x, residual, step: StepInputs, pool: KVPool, rope, attn, ops, into_bf16):
        """The first half: norm, attention or the stateful mixer -> (residual, its output)."""
        c, mm, w, i = self.config, self.mm, self.w, self.layer_idx
        if c.post_norms(i):  # OLMo 3: the residual stream goes in as it is
            residual = h = x if residual is None else residual + x
        else:
            bf16 = into_bf16(self.matmul_names[0])
            residual, h = self._add_norm(residual, x, self.input_norm, ops, bf16)
        if self.linear is not None:
            conv, state = pool.states.layer(i)
            core = self.linear(mm(h, w["in_proj"]), step.state, conv, state, ops)
            a = self.comm.all_reduce(mm(core, w["out_proj"]))
        elif self.short_conv is not None or self.mamba is not None:
            mixer = self.short_conv or self.mamba
            core = mixer(mm(h, w["in_proj"]), step.state, *pool.states.layer(i), ops=ops)
            a = self.comm.all_reduce(mm(core, w["out_proj"]))
            if c.parallel_mamba:  # Falcon-H1: the two summed
                a = a + self._attend(h, step, pool, rope, attn, ops, into_bf16)
        else:
            a = self._attend(h, step, pool, rope, attn, ops, into_bf16)
        if self.attn_out_norm is not None:
            a = rms_norm(a, self.attn_out_norm, c.rms_norm_eps)
        return residual, (a * c.residual_scale if c.residual_scale != 1.0 else a)

    def _mlp(self, h, step: StepInputs, ops, bf16_down: bool) -> torch.Tensor:
        """The gated MLP (this rank's share, before the sum over ranks)."""
        c, mm, w, lora, i = self.config, self.mm, self.w, step.lora, self.layer_idx
        # a bf16 GEMM's gate/up stays bf16 into the SiLU·mul and the down GEMM
        gate_up = (
            mm(h, w["gate_up"], bf16_out=True)
            if c.hidden_act == "silu" and getattr(mm, "keeps_bf16", False)
            else mm(h, w["gate_up"])
        )
        if lora is not None:
            gate_up = lora.apply(i, "gate_up", h, gate_up)
        if c.hidden_act == "relu2":  # Nemotron-H: up, relu², down
            act = relu_squared(gate_up)
        else:
            act = ops.silu_mul(gate_up) if c.hidden_act == "silu" else gelu_tanh_mul(gate_up)
        out = (
            mm(act, w["down"], bf16_out=True)
            if bf16_down and self.mlp_out_norm is None
            else mm(act, w["down"])
        )
        return out if lora is None else lora.apply(i, "down", act, out)

    def _attend(self, h, step: StepInputs, pool: KVPool, rope, attn, ops, into_bf16):
        """Attention over the paged K/V, through o_proj (summed over ranks)."""
        c, mm, w, lora, i = self.config, self.mm, self.w, step.lora, self.layer_idx
        num_tokens, hd = h.shape[0], self.head_dim
        qkv = mm(h, w["qkv"], self.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            qkv = lora.apply(i, "qkv", h, qkv)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, hd)
        if not self.kv_size:  # Gemma 4: K/V another layer wrote
            return self._attend_shared(q, qkv, step, pool, rope, attn, ops, into_bf16)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, hd)
        v_at = self.q_size + (0 if self.values_from_keys else self.kv_size)
        v = qkv[:, v_at : v_at + self.kv_size].view(num_tokens, self.num_kv_heads, hd)
        if c.v_norm:  # before k is normed in place (Gemma 4's full layers' values are its keys)
            v = rms_norm(v, torch.ones((), dtype=v.dtype, device=v.device), c.rms_norm_eps)
        if c.qk_norm_whole:
            q = self._whole_norm(q, self.q_norm, c.num_heads * c.head_dim)
            k = self._whole_norm(k, self.k_norm, c.num_kv_heads * c.head_dim)
        elif self.q_norm is not None:
            q, k = ops.head_norms(q, k, self.q_norm, self.k_norm, c.rms_norm_eps)
        if c.uses_rope(self.layer_idx):  # SmolLM3's NoPE layers attend without positions
            # rope: the step's tables, or (global, local) where sliding layers have their own (Gemma
            # 3)
            q, k = ops.rope(
                q,
                k,
                rope[1]
                if isinstance(rope, RopeSets) and c.window(self.layer_idx)
                else rope[0]
                if isinstance(rope, RopeSets)
                else rope,
            )
        k_cache, v_cache = pool.layer(self.layer_idx)
        attn.write_kv(k, v, k_cache, v_cache, step.slot_mapping)
        return self._attend_out(q, qkv, step, k_cache, v_cache, attn, into_bf16)

    def _attend_shared(self, q, qkv, step, pool, rope, attn, ops, into_bf16):
        """Gemma 4's last layers: their queries over K/V an earlier layer of their kind wrote."""
        c, i = self.config, self.layer_idx
        q = rms_norm(q, self.q_norm, c.rms_norm_eps)
        q = ops.rotate(q, rope[1] if c.window(i) else rope[0])
        return self._attend_out(q, qkv, step, *pool.layer(i), attn, into_bf16)

    def _attend_out(self, q, qkv, step, k_cache, v_cache, attn, into_bf16):
        """Attention over the layer's paged K/V, gated where the family gates, through o_proj."""
        c, mm, w, lora, i = self.config, self.mm, self.w, step.lora, self.layer_idx
        num_tokens = q.shape[0]
        # [num_tokens, n_heads, hd]
        o = attn.forward(
            q,
            k_cache,
            v_cache,
            step.attn_meta,
            c.attn_scale,
            c.window(self.layer_idx),
            c.attn_softcap,
            self.sinks,
        )
        o = o.reshape(num_tokens, self.q_size)
        if c.attn_output_gate:  # Qwen3.5: each query value's own gate
            o = o * torch.sigmoid(qkv[:, self.q_size + 2 * self.kv_size :])
        elif c.attn_head_gate:  # LFM: one gate a head
            gate = torch.sigmoid(qkv[:, self.q_size + 2 * self.kv_size :])
            o = (o.view(num_tokens, self.num_heads, -1) * gate[..., None]).view(num_tokens, -1)
        a = (
            mm(o, w["o_proj"], bf16_out=True)
            if into_bf16("o_proj") and self.attn_out_norm is None
            else mm(o, w["o_proj"])
        )
        a = self.comm.all_reduce(a if lora is None else lora.apply(i, "o_proj", o, a))
        return a if self.o_bias is None else a + self.o_bias.to(a.dtype)

    def _whole_norm(self, x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
        """RMSNorm of each token's whole projection (width values over all ranks) on [tokens,
        heads, head_dim]: this rank's sum of squares, summed over ranks.
        """
        f = x.float()
        squares = self.comm.all_reduce(f.pow(2).sum((1, 2), keepdim=True))
        scale = torch.rsqrt(squares / width + self.config.rms_norm_eps)
        return (f * scale * weight.float().view(x.shape[1:])).to(x.dtype)

    def _bf16_between(self, mm, ops, lora, rows: int):
        """name -> whether that projection's input and output stay bf16 this step."""
        if (
            lora is not None
            or self.comm.size > 1
            or not getattr(ops, "mixed_bf16", False)
            or not hasattr(mm, "bf16_rows")
        ):
            return lambda name: False
        return lambda name: mm.bf16_rows(rows, self.w[name])
