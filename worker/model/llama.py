"""A compact Llama-family forward over positions, slot mapping and block tables, projections fused;
families: docs/models.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.elementwise import RopeSets, Rotary, TorchOps, default_ops
from worker.model.gemma4 import PerLayerInputs
from worker.model.kv_pool import KVPool
from worker.model.layer import DecoderLayer, StepInputs
from worker.model.linear import DenseMatmul, head_library
from worker.model.parallel import Collectives, Shard, make_shard


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
            linear_heads=(c.linear_k_heads, c.linear_v_heads),
        )
        self.comm = comm or Collectives(self.shard.size)
        # this rank's vocabulary rows (all of them with one rank)
        rows = self.shard.vocab_shard_size
        self.embed = nn.Parameter(torch.empty(rows, c.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, self.shard, self.comm) for i in range(c.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        # Gemma 4: each token's input to every layer (model/gemma4.py)
        self.per_layer = PerLayerInputs(c) if c.per_layer_input_size else None
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
        """Projections and head through `lib`, weights prepared once; the loaded copies freed unless
        kept.
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
            params = (
                (self.layers[key[0]].moe.gate_up, self.layers[key[0]].moe.down)
                if key[1:] == ("experts",)
                else (self._parameter_of(key),)
            )
            for param in params:
                if param is not None:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def use_quantized(
        self, weights: dict[tuple, object], lib, keep_dense: bool = True
    ) -> dict[str, int]:
        """Projections and head on the GGUF's own blocks; unsupported types stay dense -> matrices
        by type.
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
            return QuantLinear(lib.pack(q, tail=True), dense), True

        for i, layer in enumerate(self.layers):
            layer.w = {}
            for name in layer.matmul_names:
                param = getattr(layer, name)
                layer.w[name], quantized = linear((i, name), param)
                if quantized or lib.dense.name != "dense":  # nothing reads the loaded copy any more
                    param.data = torch.empty(0, dtype=param.dtype)
            experts = weights.pop((i, "experts"), None)
            if experts is not None:  # no dense copy: experts are most of an MoE's bytes
                experts.gate_up = [lib.pack(q) for q in experts.gate_up]  # one at a time
                experts.down = [lib.pack(q) for q in experts.down]
                for q in experts.gate_up + experts.down:
                    counts[q.file_qtype] = counts.get(q.file_qtype, 0) + 1
                layer.moe.use_blocks(experts, lib)
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
        # NoPE throughout (Granite 4, Nemotron-H): no tables, which a 2^20-token context would
        # make half a GiB
        rotates = any(self.config.uses_rope(i) for i in range(self.config.num_layers))
        if self.rotary is None and rotates:
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
        if self.per_layer is not None:
            step.per_layer = self.per_layer(step.token_ids, x)
        rope = ops.rope_tables(self.rotary, step.positions, x.dtype) if rotates else None
        if self.local_rotary is not None:
            rope = RopeSets((rope, ops.rope_tables(self.local_rotary, step.positions, x.dtype)))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, step, pool, rope, attn, ops)
        if residual is None:  # the last layer handed on the stream itself (Gemma 4)
            residual, x = x, None
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
        """[rows, hidden] -> fp32 [rows, vocab] for the sampling rows; every rank gets the same."""
        if self.mm is None:
            self.use_matmul(DenseMatmul())
        if self.native_head is not None and self.native_head.covers(hidden):
            logits = self.native_head(hidden)
        else:
            # [rows, vocab_shard_size]
            logits = (self.head_mm or self.mm)(hidden, self.head).float()
        if self.shard.size > 1:
            logits = self.comm.all_gather_last(logits)[:, : self.config.vocab_size]
        if self.config.logit_scale != 1.0:  # Granite divides by its logits_scaling
            logits = logits * self.config.logit_scale
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
            if "norm" in name or name.endswith(("scalar", "scale")):
                param.data.fill_(1.0)
            elif "bias" in name:
                param.data.zero_()
            else:
                param.data.normal_(0.0, std, generator=g)
