"""A checkpoint's tensors into a LlamaModel's fused parameters: this rank's slices of the Hugging
Face-named tensors, for every family's names and layouts (the blocks a GGUF serves: gguf_plan.py).
"""

from __future__ import annotations

import torch

from worker.model.families import GEMMA4_TYPES
from worker.model.layer import DecoderLayer
from worker.model.llama import LlamaModel
from worker.model.moe import MoE
from worker.model.parallel import kv_head_range
from worker.weights.checkpoint import (
    DEFAULT_LAYER_NAMES,
    LAYER_NAMES,
    CheckpointReader,
    LayerNames,
    TensorSource,
)


@torch.no_grad()
def copy_checkpoint(model: LlamaModel, source: TensorSource) -> None:
    """Copy this rank's slices into the fused parameters; all covered, all used (LAYER_NAMES)."""
    c = model.config
    ck = CheckpointReader(source, model.embed.dtype, c.norm_offset)
    # a source may name its tensors its own way (the late-2026 families' GGUFs: the default names)
    names = getattr(source, "layer_names", None) or LAYER_NAMES.get(
        c.model_type, DEFAULT_LAYER_NAMES
    )
    vocab = (model.shard.vocab, model.shard.vocab_shard_size)
    if not ck.served(model.embed, "model.embed_tokens.weight"):
        model.embed.copy_(ck.vocab_rows("model.embed_tokens.weight", *vocab))
    model.norm.copy_(ck.norm(names.final_norm))
    if model.lm_head is not None and not ck.served(model.lm_head, "lm_head.weight"):
        model.lm_head.copy_(ck.vocab_rows("lm_head.weight", *vocab))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        _load_norms(model, ck, layer, p, names)
        if layer.linear is not None:
            _load_delta_net(model, ck, layer, p + "linear_attn.")
        elif layer.short_conv is not None:
            _load_short_conv(model, ck, layer, p + "conv.")
        elif layer.mamba is not None:
            _load_mamba(model, ck, layer, p + "mamba.")
            if c.parallel_mamba:  # Falcon-H1: attention beside it
                _load_attention(model, ck, layer, p, names)
        elif c.ffn_only(i):  # Nemotron-H: an MLP or experts alone
            pass
        else:
            _load_attention(model, ck, layer, p, names)
        if layer.moe is not None:
            _load_experts(model, ck, layer.moe, p + names.moe, names)
        if layer.shared_gate is not None:
            layer.shared_gate.copy_(ck.take(p + "mlp.shared_expert_gate.weight"))
        if layer.gate_up is not None:
            _load_mlp(model, ck, layer, p, names)
    if c.model_type in GEMMA4_TYPES:
        _load_gemma4(model, ck)
    ck.check_all_used(c.tie_word_embeddings)


def _load_norms(
    model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, p: str, names: LayerNames
) -> None:
    if model.config.post_norms(layer.layer_idx):  # OLMo 3: on attention's and MLP's outputs only
        layer.attn_out_norm.copy_(ck.norm(p + "post_attention_layernorm.weight"))
        layer.mlp_out_norm.copy_(ck.norm(p + "post_feedforward_layernorm.weight"))
        return
    c, i = model.config, layer.layer_idx
    if c.ffn_only(i) or c.mixer_only(i):  # Nemotron-H: one norm, before its one block
        target = layer.post_attn_norm if c.ffn_only(i) else layer.input_norm
        name = names.post_attention if c.ffn_only(i) else names.input_norm
        target.copy_(ck.norm(f"{p}{name}.weight"))
        return
    layer.input_norm.copy_(ck.norm(f"{p}{names.input_norm}.weight"))
    if layer.attn_out_norm is not None:  # Gemma's post-attention norm is on the attention output
        attn_out, mlp_in, mlp_out = (f"{p}{n}.weight" for n in names.sandwich)
        layer.attn_out_norm.copy_(ck.norm(attn_out))
        layer.post_attn_norm.copy_(ck.norm(mlp_in))
        layer.mlp_out_norm.copy_(ck.norm(mlp_out))
    else:
        layer.post_attn_norm.copy_(ck.norm(f"{p}{names.post_attention}.weight"))


def _load_attention(
    model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, p: str, names: LayerNames
) -> None:
    """This rank's q, k, v heads (weights, biases), q/k norms, and o_proj's columns."""
    c, sh, hd = model.config, model.shard, layer.head_dim
    a = p + "self_attn."
    q_rows = (sh.q_heads[0] * hd, sh.q_heads[1] * hd)
    kv_heads = kv_head_range(c.kv_heads_of(layer.layer_idx), sh.rank, sh.size)
    kv_rows = (kv_heads[0] * hd, kv_heads[1] * hd)
    if not layer.kv_size or layer.values_from_keys:  # Gemma 4: K/V read, or values the keys
        _load_gemma4_attention(ck, layer, a, q_rows, kv_rows)
        return
    for kind in ("weight", "bias"):
        target = layer.qkv if kind == "weight" else layer.qkv_bias
        fused = f"{p}{names.qkv}.{kind}"
        if target is None or ck.served(target, fused, *(f"{a}{x}_proj.{kind}" for x in "qkv")):
            continue
        if fused in ck:  # one tensor: this rank's rows of each part
            q_size, kv_size = c.num_heads * hd, c.num_kv_heads * hd
            parts = [
                ck.take(fused, q_rows),
                ck.take(fused, (q_size + kv_rows[0], q_size + kv_rows[1])),
                ck.take(fused, (q_size + kv_size + kv_rows[0], q_size + kv_size + kv_rows[1])),
            ]
        elif c.attn_output_gate:  # q_proj holds each head's query, then its gate: gates go last
            q = ck.take(f"{a}q_proj.{kind}", (q_rows[0] * 2, q_rows[1] * 2))
            q = q.reshape(-1, 2, hd, *q.shape[1:])
            parts = [
                q[:, 0].reshape(-1, *q.shape[3:]),
                ck.take(f"{a}k_proj.{kind}", kv_rows),
                ck.take(f"{a}v_proj.{kind}", kv_rows),
                q[:, 1].reshape(-1, *q.shape[3:]),
            ]
        else:
            parts = [
                ck.take(f"{a}q_proj.{kind}", q_rows),
                ck.take(f"{a}k_proj.{kind}", kv_rows),
                ck.take(f"{a}v_proj.{kind}", kv_rows),
            ]
            if c.attn_head_gate:  # LFM: one gate a head (its g_proj, saved as gate_proj), after v
                gate = f"{a}gate_proj.{kind}"
                parts.append(ck.take(gate if gate in ck else f"{a}g_proj.{kind}", sh.q_heads))
        target.copy_(torch.cat(parts))
    if layer.q_norm is not None and c.qk_norm_whole:  # this rank's heads' share
        layer.q_norm.copy_(ck.take(a + "q_norm.weight", q_rows) + c.norm_offset)
        layer.k_norm.copy_(ck.take(a + "k_norm.weight", kv_rows) + c.norm_offset)
    out, q_norm, k_norm = (f"{a}{n}" for n in names.attention)
    if layer.q_norm is not None and not c.qk_norm_whole:
        layer.q_norm.copy_(ck.norm(q_norm + ".weight"))
        layer.k_norm.copy_(ck.norm(k_norm + ".weight"))
    if not ck.served(layer.o_proj, out + ".weight"):
        layer.o_proj.copy_(ck.take(out + ".weight", cols=q_rows))
    if layer.o_bias is not None:  # added after the sum over ranks: whole on each
        layer.o_bias.copy_(ck.take(a + "o_proj.bias"))
    if layer.sinks is not None:
        layer.sinks.copy_(ck.take(a + "sinks", sh.q_heads))


def _load_gemma4_attention(ck: CheckpointReader, layer: DecoderLayer, a: str, q_rows, kv_rows):
    """q (and k) rows, norms and o_proj of a Gemma 4 layer that reads another's K/V or whose
    values are its keys; a reading layer's own k/v tensors, where a checkpoint keeps them, unread.
    """
    if layer.kv_size:
        rows = [ck.take(a + "q_proj.weight", q_rows), ck.take(a + "k_proj.weight", kv_rows)]
        layer.k_norm.copy_(ck.norm(a + "k_norm.weight"))
    else:
        rows = [ck.take(a + "q_proj.weight", q_rows)]
        unread = (f"{a}{x}.weight" for x in ("k_proj", "v_proj", "k_norm", "v_norm"))
        ck.loaded.update(name for name in unread if name in ck)
    if not ck.served(layer.qkv, a + "q_proj.weight", a + "k_proj.weight"):
        layer.qkv.copy_(torch.cat(rows))
    layer.q_norm.copy_(ck.norm(a + "q_norm.weight"))
    if not ck.served(layer.o_proj, a + "o_proj.weight"):
        layer.o_proj.copy_(ck.take(a + "o_proj.weight", cols=q_rows))


def _load_gemma4(model: LlamaModel, ck: CheckpointReader) -> None:
    """Per-layer token embeddings, each layer's per-layer gate and scalar, the experts beside the
    MLP with their router and norms.
    """
    c, pli = model.config, model.per_layer
    if pli is not None:
        pli.table.copy_(ck.take("model.embed_tokens_per_layer.weight"))
        pli.projection.copy_(ck.take("model.per_layer_model_projection.weight"))
        pli.norm.copy_(ck.norm("model.per_layer_projection_norm.weight"))
    for i, layer in enumerate(model.layers):
        p, out = f"model.layers.{i}.", layer.output
        out.scalar.copy_(ck.take(p + "layer_scalar"))
        if out.gate is not None:
            out.gate.copy_(ck.take(p + "per_layer_input_gate.weight"))
            out.projection.copy_(ck.take(p + "per_layer_projection.weight"))
            out.norm.copy_(ck.norm(p + "post_per_layer_input_norm.weight"))
        beside = layer.beside
        if beside is None:
            continue
        _load_experts(model, ck, beside.moe, p, GEMMA4_EXPERTS)
        beside.router_norm.copy_(ck.take(p + "router.scale") * c.hidden_size**-0.5)
        beside.expert_scale.copy_(ck.take(p + "router.per_expert_scale"))
        for param, name in (
            (beside.mlp_out_norm, "post_feedforward_layernorm_1"),
            (beside.in_norm, "pre_feedforward_layernorm_2"),
            (beside.out_norm, "post_feedforward_layernorm_2"),
        ):
            param.copy_(ck.norm(f"{p}{name}.weight"))


GEMMA4_EXPERTS = LayerNames(moe="", router="router.proj.weight")


def _load_delta_net(model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, a: str) -> None:
    """A Gated DeltaNet layer's heads on this rank: fused input projection, conv, decay, norm,
    output.
    """
    c, sh, net = model.config, model.shard, layer.linear
    dk, dv, key_dim = c.linear_k_dim, c.linear_v_dim, c.linear_k_heads * c.linear_k_dim
    (k0, k1), (v0, v1) = sh.linear_k_heads, sh.linear_v_heads
    channels = [(k0 * dk, k1 * dk), (key_dim + k0 * dk, key_dim + k1 * dk)]
    channels.append((2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv))
    names = [f"{a}in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
    if not ck.served(layer.in_proj, *names):
        parts = [ck.take(names[0], rows) for rows in channels]
        parts += [ck.take(names[1], (v0 * dv, v1 * dv))]
        parts += [ck.take(name, (v0, v1)) for name in names[2:]]
        layer.in_proj.copy_(torch.cat(parts))
    if not ck.served(layer.out_proj, a + "out_proj.weight"):
        layer.out_proj.copy_(ck.take(a + "out_proj.weight", cols=(v0 * dv, v1 * dv)))
    conv = torch.cat([ck.take(a + "conv1d.weight", rows) for rows in channels])
    net.conv.copy_(conv.reshape(net.conv.shape))
    net.dt_bias.copy_(ck.take(a + "dt_bias", (v0, v1)))
    net.a_log.copy_(ck.take(a + "A_log", (v0, v1)))
    net.norm.copy_(ck.take(a + "norm.weight"))


def _load_short_conv(model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, a: str) -> None:
    """An LFM short-conv block's channels on this rank: B, C and x rows of in_proj, the conv,
    out_proj's columns.
    """
    h, size = model.config.hidden_size, model.shard.size
    c0, c1 = model.shard.rank * h // size, (model.shard.rank + 1) * h // size
    rows = [(part * h + c0, part * h + c1) for part in range(3)]
    if not ck.served(layer.in_proj, a + "in_proj.weight"):  # or on the file's blocks
        layer.in_proj.copy_(torch.cat([ck.take(a + "in_proj.weight", r) for r in rows]))
    if not ck.served(layer.out_proj, a + "out_proj.weight"):
        layer.out_proj.copy_(ck.take(a + "out_proj.weight", cols=(c0, c1)))
    conv = layer.short_conv.conv
    conv.copy_(ck.take(a + "conv.weight", (c0, c1)).reshape(conv.shape))


def _load_mamba(model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, a: str) -> None:
    """A Mamba2 mixer's heads and groups on this rank: in_proj's z, x, B, C and dt rows, the
    conv's x, B and C channels (and bias), decays, skip, norm, out_proj's columns.
    """
    c, mixer, rank = model.config, layer.mamba, model.shard.rank
    p, heads = c.mamba_head_dim, mixer.heads
    values = (rank * heads * p, (rank + 1) * heads * p)
    rows, conv = mamba_rows(c, rank, heads, mixer.groups)
    if not ck.served(layer.in_proj, a + "in_proj.weight"):  # or on the file's blocks
        layer.in_proj.copy_(torch.cat([ck.take(a + "in_proj.weight", r) for r in rows]))
    if not ck.served(layer.out_proj, a + "out_proj.weight"):
        layer.out_proj.copy_(ck.take(a + "out_proj.weight", cols=values))
    weight = torch.cat([ck.take(a + "conv1d.weight", r) for r in conv])
    mixer.conv.copy_(weight.reshape(mixer.conv.shape))
    if a + "conv1d.bias" in ck:
        mixer.conv_bias.copy_(torch.cat([ck.take(a + "conv1d.bias", r) for r in conv]))
    heads_of = (rank * heads, (rank + 1) * heads)
    mixer.dt_bias.copy_(ck.take(a + "dt_bias", heads_of))
    mixer.a_log.copy_(ck.take(a + "A_log", heads_of))
    mixer.d.copy_(ck.take(a + "D", heads_of))
    mixer.norm.copy_(ck.take(a + "norm.weight", values))


def mamba_rows(c, rank: int, heads: int, groups: int) -> tuple[list, list]:
    """A rank's rows of a Mamba2 in_proj (z, x, B, C, dt: its heads and groups) and channels of
    its conv (x, B, C)."""
    p, n = c.mamba_head_dim, c.mamba_d_state
    inner, width = c.mamba_heads * p, c.mamba_groups * n
    values = (rank * heads * p, (rank + 1) * heads * p)
    s0, s1 = rank * groups * n, (rank + 1) * groups * n
    conv = [values, *((inner + off + s0, inner + off + s1) for off in (0, width))]
    rows = [values, *((inner + r0, inner + r1) for r0, r1 in conv)]
    dt = inner + inner + 2 * width
    rows.append((dt + rank * heads, dt + (rank + 1) * heads))
    return rows, conv


def _load_mlp(
    model: LlamaModel, ck: CheckpointReader, layer: DecoderLayer, p: str, names: LayerNames
) -> None:
    """This rank's gate/up rows (fused) and down columns (of the layer's own width)."""
    c, (lo, hi) = model.config, model.shard.intermediate
    wide = c.mlp_width(layer.layer_idx) // c.intermediate_size  # Gemma 4's doubled layers: 2
    m, inter, fused = p + names.mlp, (lo * wide, hi * wide), p + names.gate_up
    gate, up, down = (f"{x}.weight" for x in names.dense)
    if layer.moe is not None:
        m, fused, down = names.shared
        m, fused = p + m, p + m + fused
        gate, up = (f"{x}.weight" for x in DEFAULT_LAYER_NAMES.dense[:2])
    if ck.served(layer.gate_up, m + gate, m + up, fused):
        pass
    elif not model.config.gated_mlp:  # Nemotron-H: up alone
        layer.gate_up.copy_(ck.take(m + up, inter))
    elif fused in ck:  # gate then up in one tensor
        size = c.mlp_width(layer.layer_idx)
        layer.gate_up.copy_(
            torch.cat([ck.take(fused, inter), ck.take(fused, (size + inter[0], size + inter[1]))])
        )
    else:
        layer.gate_up.copy_(torch.cat([ck.take(m + gate, inter), ck.take(m + up, inter)]))
    if not ck.served(layer.down, m + down):
        layer.down.copy_(ck.take(m + down, cols=inter))


def _load_experts(
    model: LlamaModel, ck: CheckpointReader, moe: MoE, m: str, names: LayerNames
) -> None:
    """The router whole, this rank's slice of every expert (one tensor each or all in one)."""
    inter = model.shard.expert_intermediate
    gate, up, down = names.expert
    if moe.router_bias is not None:
        _load_gpt_oss_experts(model, ck, moe, m)
        return
    moe.router.copy_(ck.take(m + names.router))
    if moe.correction is not None:
        moe.correction.copy_(ck.take(m + names.correction))
    experts = range(model.config.num_experts)
    if ck.served(
        moe.gate_up, *(f"{m}experts.{e}.{p}.weight" for e in experts for p in names.expert)
    ):
        return  # on the file's blocks
    fused_gate_up, fused_down = (m + x for x in names.fused_experts)
    if fused_gate_up in ck:
        size, (i0, i1) = model.config.moe_intermediate_size, inter
        both = ck.take(fused_gate_up)
        moe.gate_up.copy_(torch.cat([both[:, i0:i1], both[:, size + i0 : size + i1]], dim=1))
        moe.down.copy_(ck.take(fused_down)[:, :, i0:i1])
        return
    for e in range(model.config.num_experts):
        x = f"{m}experts.{e}."
        if not moe.gated:  # Nemotron-H: up alone
            moe.gate_up[e].copy_(ck.take(f"{x}{up}.weight", inter))
        else:
            moe.gate_up[e].copy_(
                torch.cat([ck.take(f"{x}{gate}.weight", inter), ck.take(f"{x}{up}.weight", inter)])
            )
        moe.down[e].copy_(ck.take(f"{x}{down}.weight", cols=inter))


def _load_gpt_oss_experts(model: LlamaModel, ck: CheckpointReader, moe: MoE, m: str) -> None:
    """gpt-oss's router and experts with their biases: from its checkpoint (gate_up [E, hidden,
    2I], gate and up in alternate columns; down [E, I, hidden]) or its GGUF (gate, up and down
    apart, by expert); down's bias on rank 0 only (the ranks' shares are summed).
    """
    i0, i1 = model.shard.expert_intermediate
    experts = range(model.config.num_experts)
    moe.router.copy_(ck.take(m + "router.weight"))
    moe.router_bias.copy_(ck.take(m + "router.bias"))
    if m + "experts.gate_up_proj_blocks" in ck:  # MXFP4 as it ships: served as blocks, or widened
        bias = ck.take(m + "experts.gate_up_proj_bias")
        gate_bias, up_bias = bias[:, 0::2], bias[:, 1::2]
        _mxfp4_experts(ck, moe, m, (i0, i1))
    elif m + "experts.gate_up_proj" in ck:
        bias = ck.take(m + "experts.gate_up_proj_bias")
        gate_bias, up_bias = bias[:, 0::2], bias[:, 1::2]
        if not ck.served(moe.gate_up, m + "experts.gate_up_proj", m + "experts.down_proj"):
            both = ck.take(m + "experts.gate_up_proj")
            gate, up = both[:, :, 0::2][:, :, i0:i1], both[:, :, 1::2][:, :, i0:i1]
            moe.gate_up.copy_(torch.cat([gate, up], dim=2).transpose(1, 2))
            moe.down.copy_(ck.take(m + "experts.down_proj")[:, i0:i1].transpose(1, 2))
    else:
        gate_bias = ck.take(m + "experts.gate_proj_bias")
        up_bias = ck.take(m + "experts.up_proj_bias")
        names = [f"{m}experts.{e}.{p}.weight" for e in experts for p in PROJ]
        if not ck.served(moe.gate_up, *names):
            for e in experts:
                x = f"{m}experts.{e}."
                moe.gate_up[e].copy_(
                    torch.cat(
                        [
                            ck.take(x + "gate_proj.weight", (i0, i1)),
                            ck.take(x + "up_proj.weight", (i0, i1)),
                        ]
                    )
                )
                moe.down[e].copy_(ck.take(x + "down_proj.weight", cols=(i0, i1)))
    moe.gate_up_bias.copy_(torch.cat([gate_bias[:, i0:i1], up_bias[:, i0:i1]], dim=1))
    down_bias = ck.take(m + "experts.down_proj_bias")
    moe.down_bias.copy_(down_bias if model.shard.rank == 0 else torch.zeros_like(down_bias))


PROJ = ("gate_proj", "up_proj", "down_proj")


def _mxfp4_experts(ck: CheckpointReader, moe: MoE, m: str, inter: tuple[int, int]) -> None:
    """The checkpoint's MXFP4 experts: used as blocks where served, else dequantized (gate_up's
    rows [E, 2I, hidden] alternate gate and up; down's [E, hidden, I])."""
    from worker.weights.mxfp4 import dequantize

    names = [
        m + f"experts.{p}_{k}" for p in ("gate_up_proj", "down_proj") for k in ("blocks", "scales")
    ]
    if ck.served(moe.gate_up, *names):
        return
    i0, i1 = inter
    both = dequantize(ck.take_raw(names[0]), ck.take_raw(names[1]))
    moe.gate_up.copy_(torch.cat([both[:, 0::2][:, i0:i1], both[:, 1::2][:, i0:i1]], dim=1))
    moe.down.copy_(dequantize(ck.take_raw(names[2]), ck.take_raw(names[3]))[:, :, i0:i1])
