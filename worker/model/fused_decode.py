"""The fused CPU decode step: a decode-only step as one native call; the layer path stays the
definition.
"""

from __future__ import annotations

import ctypes

import structlog
import torch

from kernels.cpu_step import (
    MAX_SEGMENTS,
    PsLayer,
    PsLora,
    PsLoraProj,
    PsMatrix,
    PsModel,
    PsSegment,
    mirrors_match,
)
from worker.model.delta_net import copy_after
from worker.model.families import GEMMA4_TYPES

log = structlog.get_logger("worker.model.fused_decode")
_P, _I32 = ctypes.c_void_p, ctypes.c_int32

# PsModel.gelu: the MLP's activation (relu²: Nemotron-H's ungated up alone)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "relu2": 2}
LORA_ORDER = ("qkv", "o_proj", "gate_up", "down")  # decode_step.c's order of a layer's projections


def _native_lora(weights, num_layers: int):
    """An adapter's projections as the fused step reads them, or False if not plain fp32."""
    if weights.native is None:
        projs = (PsLoraProj * (num_layers * 4))()
        ok = len(weights.layers) == num_layers
        for i, layer in enumerate(weights.layers if ok else ()):
            for j, name in enumerate(LORA_ORDER):
                p = layer.get(name)
                if p is None:
                    continue
                if not (
                    _plain(p.a)
                    and all(_plain(b) for b in p.bs)
                    and 0 < len(p.parts) <= MAX_SEGMENTS
                ):
                    ok = False
                    break
                parts = ((_I32 * 4) * MAX_SEGMENTS)(*((_I32 * 4)(*q) for q in p.parts))
                bs = (_P * MAX_SEGMENTS)(*(b.data_ptr() for b in p.bs))
                projs[i * 4 + j] = PsLoraProj(
                    p.a.data_ptr(), bs, p.a.shape[0], p.lo, p.hi, len(p.parts), parts
                )
        weights.native = projs if ok else False
    return weights.native


def _step_lora(lora, num_layers: int) -> tuple[PsLora, tuple] | None:
    """The step's adapters as a PsLora, or None where the fused step cannot read one."""
    natives = [_native_lora(w, num_layers) for w in lora.adapters]
    if not all(natives) or lora.index is None:
        return None
    size = ctypes.sizeof(PsLoraProj) * num_layers * 4
    projs = (PsLoraProj * (num_layers * 4 * len(natives)))()
    for g, n in enumerate(natives):
        ctypes.memmove(ctypes.addressof(projs) + g * size, ctypes.addressof(n), size)
    rows = lora.index.to(torch.int32).contiguous()
    return PsLora(ctypes.addressof(projs), rows.data_ptr(), len(natives), 0), (projs, rows)


def _mixer(layer):
    """A layer's stateful mixer (Mamba2, Gated DeltaNet, a short conv), or None."""
    for mixer in (layer.mamba, layer.linear, layer.short_conv):
        if mixer is not None:
            return mixer
    return None


def _plain(w) -> bool:
    return (
        isinstance(w, torch.Tensor)
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.numel() > 0
        and w.is_contiguous()
        and w.layout == torch.strided
        and not w.is_mkldnn
    )


def _matrix(layer, name: str) -> tuple[PsMatrix, list[torch.Tensor]] | None:
    """One projection as the fused step reads it; None where it cannot."""
    from worker.model.quant_weights import QuantLinear, QuantStack, QuantWeight

    w = layer.w.get(name)
    dense = None
    if isinstance(w, QuantLinear):
        w, dense = w.q, (w.dense if _plain(w.dense) else None)
    if isinstance(w, (QuantWeight, QuantStack)) and len(w.segments) <= MAX_SEGMENTS:
        segs = [PsSegment(p.data.data_ptr(), p.out_dim, p.type_id, 0) for p in w.segments]
        keep = [p.data for p in w.segments] + ([dense] if dense is not None else [])
        return PsMatrix((PsSegment * MAX_SEGMENTS)(*segs), w.out_dim, w.in_dim, _ptr(dense)), keep
    for t in (w, getattr(layer, name)):
        if _plain(t):
            return PsMatrix(
                (PsSegment * MAX_SEGMENTS)(PsSegment(t.data_ptr(), t.shape[0], 0, 0)),
                t.shape[0],
                t.shape[1],
                t.data_ptr(),
            ), [t]
    return None


def matrix_bytes(layer) -> dict[str, int]:
    """Bytes each projection's row kernels read a token."""
    out = {}
    for name in layer.matmul_names:
        desc = _matrix(layer, name)
        if desc is not None:
            keep = desc[1][:-1] if desc[0].dense and len(desc[1]) > 1 else desc[1]
            out[name] = sum(t.numel() * t.element_size() for t in keep)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The model handed to the library once, so a decode step is one call (per-layer overhead was a
    third of a one-stream step).
    """

    def __init__(self, kernels, model, max_rows: int) -> None:
        if not mirrors_match(kernels):
            raise RuntimeError(
                "the fused decode step's structs differ from kernels/cpu/pagedserve.h's"
            )
        self.kernels = kernels
        self.model = model
        self.max_rows = max_rows
        # past max_rows, with fp32 copies and a BLAS sgemm, the step multiplies there for any rows
        dense = all(
            _matrix(layer, name)[0].dense for layer in model.layers for name in layer.matmul_names
        )
        self.sgemm = kernels.sgemm if dense else None
        self._pool = None
        self._scratch = torch.empty(0)
        self.stateful = [i for i, layer in enumerate(model.layers) if _mixer(layer) is not None]

    @staticmethod
    def unsupported(model, tp_size: int) -> str | None:
        """Why the fused step cannot run this model (None: it can)."""
        c = model.config
        if tp_size > 1:
            return "tensor parallelism (the layer path all-reduces between stages)"
        if model.embed.device.type != "cpu" or model.embed.dtype != torch.float32:
            return f"{model.embed.dtype} on {model.embed.device.type} (fp32 on a CPU only)"
        q_size = c.num_heads * c.head_dim
        if c.hidden_size % 32 or c.intermediate_size % 32 or q_size % 32 or c.head_dim % 2:
            return "dimensions not multiples of 32"
        refusals = (layer.moe.fused_refusal() for layer in model.layers if layer.moe is not None)
        if (why := next((r for r in refusals if r), None)) is not None:
            return why
        if len(set(c.layer_widths)) > 1:
            return "MLPs of different widths (the layer path)"
        if c.model_type in GEMMA4_TYPES:
            return "Gemma 4's per-layer inputs and shared K/V (the layer path)"
        if c.hidden_act not in ACTIVATIONS or c.gated_mlp != (c.hidden_act != "relu2"):
            return f"a {c.hidden_act} MLP (the fused step gates by SiLU or GELU-tanh, or relu²s up)"
        for layer in model.layers:
            for name in layer.matmul_names:
                if _matrix(layer, name) is None:
                    return (
                        f"{model.mm.name} weights only (the fused step reads GGUF blocks "
                        "or plain fp32 rows)"
                    )
        return None

    def covers(self, step, num_tokens: int) -> bool:
        from worker.model.attention_native import CpuAttentionMeta

        meta = step.attn_meta
        if not (
            isinstance(meta, CpuAttentionMeta)
            and 0 < num_tokens
            and (num_tokens <= self.max_rows or self.sgemm)
            and meta.decode_rows.numel() == num_tokens
            and meta.prefill_starts.numel() == 0
        ):
            return False
        if self.stateful and (step.state is None or not step.state.decode_only or step.lora):
            return False  # Mamba2 layers: one token a sequence, no adapters
        # the step's adapters described for the native step (None: it cannot)
        if step.lora is not None:
            step.lora.native = _step_lora(step.lora, self.model.config.num_layers)
            return step.lora.native is not None
        return True

    def _describe(self, pool) -> None:
        """Model, weights and caches as the native step reads them (once per pool)."""
        m, c = self.model, self.model.config
        keep, layers = [], (PsLayer * c.num_layers)()
        local = m.local_rotary  # Gemma 3's sliding layers' own tables
        for i, layer in enumerate(m.layers):
            layers[i] = self._layer(i, layer, pool, local, keep)
        rotary = m.rotary
        self._desc = PsModel(
            c.num_layers,
            c.hidden_size,
            m.shard.num_q_heads,
            m.shard.num_kv_heads,
            c.head_dim,
            m.shard.intermediate_size,
            pool.block_size,
            c.rotary_dim // 2,
            c.rms_norm_eps,
            c.attn_scale,
            _ptr(rotary and rotary.cos),  # None where no layer rotates
            _ptr(rotary and rotary.sin),
            _ptr(m.norm),
            layers,
            self.sgemm,
            self.max_rows,
            int(pool.dtype == torch.bfloat16),
            int(getattr(m.mm, "int8_activations", False)),
            c.residual_scale,
            ACTIVATIONS[c.hidden_act],
            c.attn_softcap,
        )
        self._keep = (keep, layers, rotary, local)
        self._pool = pool

    def _layer(self, i: int, layer, pool, local, keep: list) -> PsLayer:
        """Layer i as the native step reads it; keep: what its pointers point into."""
        c = self.model.config
        mats = {}
        for name in layer.matmul_names:
            desc, tensors = _matrix(layer, name)
            mats[name] = desc
            keep.extend(tensors)
        k_cache, v_cache = pool.layer(i)
        # a stateful mixer as the library reads it over its layer of the state pool
        mixer_of = _mixer(layer)
        state = None if mixer_of is None else mixer_of.native(*pool.states.layer(i))
        if mixer_of is not None and state is None:
            raise ValueError(f"layer {i}'s state is not fp32 on a CPU")
        keep.append(state)
        beside = None
        if c.parallel_mamba:  # Falcon-H1: attention here, its Mamba2 a layer of its own beside
            beside = PsLayer(qkv=mats["in_proj"], o_proj=mats["out_proj"])
            beside.mamba = ctypes.addressof(state)
            keep.append(beside)
        mixer = ("qkv", "o_proj") if state is None or beside else ("in_proj", "out_proj")
        alone = state is not None and beside is None  # the stateful mixer in attention's place
        experts = None
        if layer.moe is not None:
            experts = layer.moe.described(keep)
            keep.append(experts)
        sinks, o_bias = (  # gpt-oss's, fp32
            None if t is None else t.detach().float().contiguous()
            for t in (layer.sinks, layer.o_bias)
        )
        keep.extend((sinks, o_bias))
        post_only = c.post_norms(i)  # OLMo 3: the residual stream goes in unnormed
        # a half the layer lacks (Nemotron-H's MLP or mixer alone; experts, no shared one): no rows
        return PsLayer(
            *(mats.get(name, PsMatrix()) for name in (*mixer, "gate_up", "down")),
            *(None, None) if post_only else (_ptr(layer.input_norm), _ptr(layer.post_attn_norm)),
            _ptr(layer.qkv_bias),
            _ptr(layer.q_norm),
            _ptr(layer.k_norm),
            _ptr(k_cache),
            _ptr(v_cache),
            int(c.uses_rope(i)),
            c.window(i),
            ctypes.addressof(state) if alone and layer.mamba is not None else None,
            ctypes.addressof(state) if layer.linear is not None else None,
            0 if alone else 1 if c.attn_output_gate else 2 * c.attn_head_gate,
            int(c.qk_norm_whole),
            _ptr(layer.attn_out_norm),
            _ptr(layer.mlp_out_norm),
            *((_ptr(local.cos), _ptr(local.sin)) if c.window(i) and local else (None, None)),
            ctypes.addressof(state) if layer.short_conv is not None else None,
            None if beside is None else ctypes.addressof(beside),
            None if experts is None else ctypes.addressof(experts),
            _ptr(layer.shared_gate),
            _ptr(sinks),
            _ptr(o_bias),
        )

    def forward(self, x: torch.Tensor, step, pool) -> torch.Tensor:
        """x: the step's embeddings [rows, hidden] (overwritten) -> the final-norm hidden states."""
        if self._pool is not pool:
            self._describe(pool)
        meta = step.attn_meta
        rows = x.shape[0]
        need = self.kernels.decode_step_scratch(self._desc, rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        x = x.contiguous()
        tables = meta.decode_tables
        self.kernels.decode_step(
            self._desc,
            rows,
            x,
            step.positions.to(torch.int64).contiguous(),
            step.slot_mapping.to(torch.int64).contiguous(),
            tables,
            meta.decode_lens,
            self._scratch,
            None if step.lora is None else step.lora.native[0],
            step.state.slots.to(torch.int64).contiguous() if self.stateful else None,
        )
        for i in self.stateful:  # snapshots where rows end (speculation, prefix states)
            copy_after(step.state, pool.states.layer(i))
        return x


class NativeHead:
    """The LM head on the native rows kernel: the matrix read once for up to eight rows."""

    def __init__(self, kernels, weight: torch.Tensor, max_rows: int) -> None:
        self.kernels = kernels
        self.weight = weight
        self.bytes = weight.view(torch.uint8)  # type 0 of the kernel: rows of fp32 values
        self.max_rows = max_rows

    @staticmethod
    def weight_of(model) -> torch.Tensor | None:
        """The head as plain fp32 rows, or None: a quantized head keeps its own kernel."""
        from worker.model.quant_weights import QuantLinear, QuantStack, QuantWeight

        if isinstance(model.head, (QuantLinear, QuantStack, QuantWeight)):
            return None
        for t in (model.head, model.lm_head if model.lm_head is not None else model.embed):
            if _plain(t) and t.shape[0] == model.shard.vocab_shard_size and t.shape[1] % 32 == 0:
                return t
        return None

    def covers(self, hidden: torch.Tensor) -> bool:
        return (
            0 < hidden.shape[0] <= self.max_rows
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
        )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.contiguous()
        y = torch.empty(x.shape[0], self.weight.shape[0])
        self.kernels.quant_matmul(x, self.bytes, 0, self.weight.shape[0], y)
        return y
