"""A compact Llama-family forward over positions, slot mapping and block tables, projections fused;
families: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.elementwise import RopeSets, Rotary, TorchOps, default_ops, rms_norm
from worker.model.kv_pool import KVPool
from worker.model.linear import DenseMatmul, head_library
from worker.model.lora import StepLora
from worker.model.moe import MoE
from worker.model.parallel import Collectives, Shard, make_shard


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    attn_meta: object  # the backend's per-step metadata (built once, shared by all layers)
    # LoRA adapters' updates of the step's rows (model/lora.py), where any
    lora: StepLora | None = None


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, over [rows, 2 * I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, shard: Shard, comm: Collectives
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.comm = comm
        self.num_heads = shard.num_q_heads  # this rank's heads
        self.num_kv_heads = shard.num_kv_heads
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, c.hidden_size))
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_rows)) if c.attention_bias else None
        self.q_norm = nn.Parameter(torch.ones(c.head_dim)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(c.head_dim)) if c.qk_norm else None
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, self.q_size))
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))  # before the MLP
        # Gemma's norms of the attention and MLP outputs, before each residual add
        self.attn_out_norm = nn.Parameter(torch.ones(c.hidden_size)) if c.sandwich_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(c.hidden_size)) if c.sandwich_norms else None
        # the MLP: dense (gate and up stacked), or a mixture of experts
        self.moe = MoE(c, shard) if c.is_moe(layer_idx) else None
        self.gate_up = (
            None
            if self.moe
            else nn.Parameter(torch.empty(2 * shard.intermediate_size, c.hidden_size))
        )
        self.down = (
            None if self.moe else nn.Parameter(torch.empty(c.hidden_size, shard.intermediate_size))
        )
        self.matmul_names = self.MATMUL_WEIGHTS[:2] if self.moe else self.MATMUL_WEIGHTS
        # kept when released
        self.shapes = {name: tuple(getattr(self, name).shape) for name in self.matmul_names}
        self.config = c
        # the matmul library and the weights in its layout (LlamaModel.use_matmul)
        self.mm = DenseMatmul()
        self.w: dict[str, torch.Tensor] = {}

    MATMUL_WEIGHTS = ("qkv", "o_proj", "gate_up", "down")

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
        """Add x to the residual (fused with the norm), then attention and MLP; -> (MLP output,
        residual).
        """
        c = self.config
        num_tokens = x.shape[0]
        mm, w, lora, i = self.mm, self.w, step.lora, self.layer_idx
        into_bf16 = self._bf16_between(mm, ops, lora, num_tokens)
        if residual is None:
            residual, h = ops.add_rms_norm(
                x, None, self.input_norm, c.rms_norm_eps, into_bf16("qkv")
            )
        else:
            residual, h = ops.add_rms_norm(
                residual, x, self.input_norm, c.rms_norm_eps, into_bf16("qkv")
            )
        qkv = mm(h, w["qkv"], self.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            qkv = lora.apply(i, "qkv", h, qkv)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, c.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            num_tokens, self.num_kv_heads, c.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
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
        # [num_tokens, n_heads, hd]
        o = attn.forward(
            q,
            k_cache,
            v_cache,
            step.attn_meta,
            c.attn_scale,
            c.window(self.layer_idx),
            c.attn_softcap,
        )
        o = o.reshape(num_tokens, self.q_size)
        a = (
            mm(o, w["o_proj"], bf16_out=True)
            if into_bf16("o_proj") and self.attn_out_norm is None
            else mm(o, w["o_proj"])
        )
        a = self.comm.all_reduce(a if lora is None else lora.apply(i, "o_proj", o, a))
        if self.attn_out_norm is not None:
            a = rms_norm(a, self.attn_out_norm, c.rms_norm_eps)
        residual, h = ops.add_rms_norm(
            residual,
            a,
            self.post_attn_norm,
            c.rms_norm_eps,
            self.moe is None and into_bf16("gate_up"),
        )
        if self.moe is not None:
            out = self.comm.all_reduce(self.moe(h, ops))
        else:
            # a bf16 GEMM's gate/up stays bf16 into the SiLU·mul and the down GEMM
            gate_up = (
                mm(h, w["gate_up"], bf16_out=True)
                if c.hidden_act == "silu" and getattr(mm, "keeps_bf16", False)
                else mm(h, w["gate_up"])
            )
            if lora is not None:
                gate_up = lora.apply(i, "gate_up", h, gate_up)
            act = ops.silu_mul(gate_up) if c.hidden_act == "silu" else gelu_tanh_mul(gate_up)
            out = (
                mm(act, w["down"], bf16_out=True)
                if into_bf16("down") and self.mlp_out_norm is None
                else mm(act, w["down"])
            )
            out = self.comm.all_reduce(out if lora is None else lora.apply(i, "down", act, out))
        if self.mlp_out_norm is not None:
            out = rms_norm(out, self.mlp_out_norm, c.rms_norm_eps)
        return out, residual

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


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, shard: Shard | None = None, comm: Collectives | None = None
    ) -> None:
        super().__init__()
        c = config
        self.config = config
        self.shard = shard or make_shard(
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            c.vocab_size,
            expert_intermediate_size=c.moe_intermediate_size,
        )
        self.comm = comm or Collectives(self.shard.size)
        # this rank's vocabulary rows (all of them with one rank)
        rows = self.shard.vocab_shard_size
        self.embed = nn.Parameter(torch.empty(rows, c.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, self.shard, self.comm) for i in range(c.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Parameter(torch.empty(rows, c.hidden_size))
        )
        self.head_shape = (rows, c.hidden_size)
        # QuantEmbedding (model/quantized.py): lookups from the file's blocks, where set
        self.embed_q = None
        # set by worker/weights/loader.py, for use_quantized
        self.file_blocks: dict[tuple, object] = {}
        self.rotary: Rotary | None = None
        self.local_rotary: Rotary | None = None  # Gemma 3's sliding layers' own
        # set by use_matmul (dense F.linear on the loaded weights unless told otherwise)
        self.mm = None
        # the elementwise tail (worker/model/elementwise.py), chosen at the first forward
        self.ops: TorchOps | None = None
        self.head: torch.Tensor | None = None  # the LM head as the head's matmul library holds it
        self.head_mm = None  # the LM head's library: the projections' unless that one names another
        # worker/model/fused_decode.py: decode-only steps in one native call, where set
        self.fused = None
        # NativeHead (model/fused_decode.py): a few rows' logits on plain fp32 rows
        self.native_head = None

    def use_matmul(self, lib, drop_dense: bool = True) -> None:
        """Run projections and LM head through `lib` with weights prepared once; the loaded copies
        are freed unless kept.
        """
        drop = drop_dense and lib.name != "dense"
        for layer in self.layers:
            layer.use_matmul(lib, drop)
        self.head_mm = head_library(lib, self.embed.device, self.embed.dtype)
        self.head = self.head_mm.prepare(self.embed if self.lm_head is None else self.lm_head)
        if drop and self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        self.mm = lib

    def _parameter_of(self, key: tuple) -> nn.Parameter | None:
        if key == ("head",):
            # tied: the embeddings stay for lookup unless served on their own blocks
            return self.lm_head
        if key == ("embed",):
            return self.embed
        return getattr(self.layers[key[0]], key[1])

    def release(self, weights: dict[tuple, object]) -> None:
        """Give up the parameters `weights` serve, so a quantized model is never held in fp32."""
        for key in weights:
            param = self._parameter_of(key)
            if param is not None:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def use_quantized(
        self, weights: dict[tuple, object], lib, keep_dense: bool = True
    ) -> dict[str, int]:
        """Serve projections and LM head from the GGUF's own blocks; types the kernels lack stay
        dense. keep_dense also keeps a dense copy for prefill. Returns matrices by type.
        """
        from worker.model.quant_weights import QuantEmbedding, QuantLinear

        counts: dict[str, int] = {}

        # each weight leaves `weights` as it is packed: one matrix held twice at most
        def linear(key, param):
            q = weights.pop(key, None)
            if q is None:
                counts["dense"] = counts.get("dense", 0) + 1
                return lib.dense.prepare(param), False
            counts[q.file_qtype] = counts.get(q.file_qtype, 0) + 1
            # prefill's copy is the blocks' own values, whatever the loaded parameter held
            dense = (lib.copies or lib.dense).prepare(lib.dequantize(q)) if keep_dense else None
            return QuantLinear(lib.pack(q), dense), True

        for i, layer in enumerate(self.layers):
            layer.w = {}
            for name in layer.matmul_names:
                param = getattr(layer, name)
                layer.w[name], quantized = linear((i, name), param)
                if quantized or lib.dense.name != "dense":  # nothing reads the loaded copy any more
                    param.data = torch.empty(0, dtype=param.dtype)
            layer.mm = lib
        embed = weights.pop(("embed",), None)
        if embed is not None:
            self.embed_q = QuantEmbedding(lib.kernels, embed)
            self.embed.data = torch.empty(0, dtype=self.embed.dtype)
        self.head, quantized = linear(
            ("head",), self.embed if self.lm_head is None else self.lm_head
        )
        # the embeddings stay: lookup
        if self.lm_head is not None and (quantized or lib.dense.name != "dense"):
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        self.mm = self.head_mm = lib
        return counts

    def matmul_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of each projection of a layer, for choosing a matmul library by measurement."""
        # a dense layer where there is one
        layer = min(self.layers, key=lambda x: x.moe is not None)
        return [layer.shapes[n] for n in layer.matmul_names]

    def forward(self, step: StepInputs, pool: KVPool, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden_size]."""
        if self.rotary is None:
            self.rotary = Rotary(self.config, self.embed.device)
            local = self.config.local_rope_config()
            self.local_rotary = Rotary(local, self.embed.device) if local is not None else None
        if self.mm is None:
            self.use_matmul(DenseMatmul())
        if self.ops is None:
            self.ops = default_ops(self.embed.device, self.embed.dtype)
        ops = self.ops
        x = self._embed(step.token_ids)
        if self.fused is not None and self.fused.covers(step, x.shape[0]):
            return self.fused.forward(x, step, pool)
        rope = ops.rope_tables(self.rotary, step.positions, x.dtype)
        if self.local_rotary is not None:
            rope = RopeSets((rope, ops.rope_tables(self.local_rotary, step.positions, x.dtype)))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, step, pool, rope, attn, ops)
        return ops.add_rms_norm(residual, x, self.norm, self.config.rms_norm_eps)[1]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(token_ids)
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def _lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_q or (lambda ids: F.embedding(ids, self.embed))
        if self.shard.size == 1:
            return table(token_ids)
        lo = self.shard.vocab[0]
        local = token_ids - lo
        outside = (local < 0) | (local >= self.shard.vocab[1] - lo)  # ids another rank holds
        x = table(local.clamp(0, self.head_shape[0] - 1))
        return self.comm.all_reduce(x.masked_fill(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden_size] -> fp32 logits [rows, vocab_size]; only rows that sample are passed.
        Every rank of a group calls it with the same rows and gets the same logits."""
        if self.mm is None:
            self.use_matmul(DenseMatmul())
        if self.native_head is not None and self.native_head.covers(hidden):
            logits = self.native_head(hidden)
        else:
            # [rows, vocab_shard_size]
            logits = (self.head_mm or self.mm)(hidden, self.head).float()
        if self.shard.size > 1:
            logits = self.comm.all_gather_last(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights at the real shapes ("dummy" loading, for benchmarks)."""
        g = None
        for name, param in self.named_parameters():
            # on the parameters' own device: nothing is drawn on the host and copied over
            if g is None:
                g = torch.Generator(device=param.device).manual_seed(seed * 1009 + self.shard.rank)
            if "norm" in name:
                param.data.fill_(1.0)
            elif "bias" in name:
                param.data.zero_()
            else:
                param.data.normal_(0.0, std, generator=g)
