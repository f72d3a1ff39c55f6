"""The GGUF blocks that will serve a LlamaModel's matrices: this rank's slices of each block-served
matrix, stacked as the model fuses them (q/k/v, gate/up, a Gated DeltaNet's projections, every
expert); what the file holds in other types loads dense.
"""

from __future__ import annotations

import torch

from worker.model.llama import LlamaModel
from worker.weights.fill import mamba_rows


def read_quantized(
    model: LlamaModel, source, embeddings: bool = False, pack=None
) -> dict[tuple, object]:
    """This rank's slices of each block-served matrix, stacked as fused; other types load dense."""
    from worker.model.quant_weights import QuantWeight

    c, sh = model.config, model.shard

    def quant(parts, cols=None, rows_to=None, packed=True):
        """rows_to: zero blocks padding the short last vocabulary shard."""
        if any(source.qtype(name) is None for name, _ in parts):
            return None
        try:
            q = QuantWeight.cat([source.get(name, rows, cols) for name, rows in parts])
        except ValueError:
            return None
        if rows_to is not None and q.out_dim < rows_to:
            pad = torch.zeros(rows_to - q.out_dim, q.data.shape[1], dtype=torch.uint8)
            q = QuantWeight(torch.cat([q.data, pad]), q.qtype, q.in_dim)
        return pack(q) if pack is not None and packed else q

    found: dict[tuple, object] = {}
    for i, layer in enumerate(model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        plan = {}
        if layer.linear is not None:
            plan.update(_delta_net_blocks(c, sh, quant, f"model.layers.{i}.linear_attn."))
        elif layer.qkv is not None:
            plan.update(_attention_blocks(c, sh, quant, a))
        plan.update(_mixer_blocks(c, sh, quant, layer, f"model.layers.{i}."))
        # experts on their blocks where the file's types are served; a shared expert as a dense MLP
        if layer.moe is not None:
            experts = _expert_blocks(c, sh, quant, m)
            if experts is not None:
                found[(i, "experts")] = experts
            m += "shared_expert."
        if layer.gate_up is not None:  # gate and up, or (Nemotron-H) up alone
            gate = [(m + "gate_proj.weight", sh.intermediate)] if c.gated_mlp else []
            plan["gate_up"] = quant([*gate, (m + "up_proj.weight", sh.intermediate)])
            plan["down"] = quant([(m + "down_proj.weight", None)], cols=sh.intermediate)
        found.update(
            {
                (i, name): q
                for name, q in plan.items()
                if q is not None and tuple(q.shape) == layer.shapes[name]
            }
        )
    head = quant([("lm_head.weight", sh.vocab)], rows_to=sh.vocab_shard_size)
    if head is not None and tuple(head.shape) == model.head_shape:
        found[("head",)] = head
    tied_dense = model.lm_head is None and ("head",) not in found  # the dense head reads the table
    table = (
        quant([("model.embed_tokens.weight", sh.vocab)], rows_to=sh.vocab_shard_size, packed=False)
        if embeddings and not tied_dense
        else None
    )
    if table is not None:
        found[("embed",)] = table
    return found


def _attention_blocks(c, sh, quant, a: str) -> dict:
    """This rank's q, k, v heads stacked as qkv (a gated query's gates last), o_proj's columns."""
    hd = c.head_dim
    q_rows = (sh.q_heads[0] * hd, sh.q_heads[1] * hd)
    kv_rows = (sh.kv_heads[0] * hd, sh.kv_heads[1] * hd)
    kv = [(a + "k_proj.weight", kv_rows), (a + "v_proj.weight", kv_rows)]
    query = [(a + "q_proj.weight", q_rows)]
    gates = []
    if c.attn_output_gate:  # q_proj holds each head's query, then its gate: gates go last
        heads = range(sh.q_heads[0], sh.q_heads[1])
        query = [(a + "q_proj.weight", (2 * h * hd, (2 * h + 1) * hd)) for h in heads]
        gates = [(a + "q_proj.weight", ((2 * h + 1) * hd, (2 * h + 2) * hd)) for h in heads]
    return {
        "qkv": quant(query + kv + gates),
        "o_proj": quant([(a + "o_proj.weight", None)], cols=q_rows),
    }


def _expert_blocks(c, sh, quant, m: str):
    """Every expert's gate/up (this rank's rows) and down (its columns) as blocks, or None where a
    type is not served (the experts load dense then).
    """
    from worker.model.quant_weights import ExpertBlocks

    inter, gate_up, down = sh.expert_intermediate, [], []
    for e in range(c.num_experts):
        x = f"{m}experts.{e}."
        gate = [(x + "gate_proj.weight", inter)] if c.gated_mlp else []  # Nemotron-H: up alone
        gate_up.append(quant([*gate, (x + "up_proj.weight", inter)]))
        down.append(quant([(x + "down_proj.weight", None)], cols=inter))
        if gate_up[-1] is None or down[-1] is None:
            return None
    return ExpertBlocks(gate_up, down)


def _mixer_blocks(c, sh, quant, layer, p: str) -> dict:
    """A Mamba2 mixer's or a short conv's in_proj and out_proj on this rank, as quant reads them."""
    if layer.mamba is not None:  # its in_proj's rows of this rank's heads and groups
        rows, _ = mamba_rows(c, sh.rank, layer.mamba.heads, layer.mamba.groups)
        x = p + "mamba."
        return {
            "in_proj": quant([(x + "in_proj.weight", r) for r in rows]),
            "out_proj": quant([(x + "out_proj.weight", None)], cols=rows[0]),
        }
    if layer.short_conv is not None:  # B, C and x rows of this rank's channels
        h, x = c.hidden_size, p + "conv."
        ch = (sh.rank * h // sh.size, (sh.rank + 1) * h // sh.size)
        parts = [(x + "in_proj.weight", (k * h + ch[0], k * h + ch[1])) for k in range(3)]
        return {
            "in_proj": quant(parts),
            "out_proj": quant([(x + "out_proj.weight", None)], cols=ch),
        }
    return {}


def _delta_net_blocks(c, sh, quant, a: str) -> dict:
    """A Gated DeltaNet layer's projections from blocks, this rank's heads."""
    dk, dv, key_dim = c.linear_k_dim, c.linear_v_dim, c.linear_k_heads * c.linear_k_dim
    (k0, k1), (v0, v1) = sh.linear_k_heads, sh.linear_v_heads
    qkv = a + "in_proj_qkv.weight"
    channels = [(k0 * dk, k1 * dk), (key_dim + k0 * dk, key_dim + k1 * dk)]
    channels.append((2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv))
    parts = [(qkv, rows) for rows in channels] + [(a + "in_proj_z.weight", (v0 * dv, v1 * dv))]
    if c.model_type == "qwen3_next":  # b and a in one tensor: each key head's b rows, its a rows
        r = c.linear_v_heads // c.linear_k_heads
        ba = a + "in_proj_ba.weight"
        parts += [(ba, (h * 2 * r, h * 2 * r + r)) for h in range(k0, k1)]
        parts += [(ba, (h * 2 * r + r, (h + 1) * 2 * r)) for h in range(k0, k1)]
    else:
        parts += [(a + f"in_proj_{x}.weight", (v0, v1)) for x in ("b", "a")]
    return {
        "in_proj": quant(parts),
        "out_proj": quant([(a + "out_proj.weight", None)], cols=(v0 * dv, v1 * dv)),
    }
