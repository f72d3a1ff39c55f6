"""A tiny Qwen3.5 (dense or MoE) shipped as llama.cpp's `convert_hf_to_gguf.py --outtype q8_0` ships
one: `qwen35` / `qwen35moe` names, value heads reordered from grouped to tiled, A as -exp(A_log),
norms holding 1 + w, the conv squeezed, projections and experts in Q8_0 blocks, the rest F32. Beside
it, the folder prepare-model makes of such a file (config from its header, tokenizer, no weights),
and a Hugging Face folder of the weights the file holds, the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from worker.weights.gguf_blocks import GGUFQuantSource

NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# the projections under llama.cpp's names (the Gated DeltaNet's are written by _linear, tiled)
MATRICES = {
    **{k: v for k, v in GGUFQuantSource.LAYER.items() if not k.startswith("linear_attn.")},
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def make_qwen35_gguf(root: Path, family: str, seed: int, **overrides) -> tuple[Path, Path]:
    """-> (the folder to serve, the reference folder)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file, save_file

    from tests.support.tiny import make_tiny_llama
    from worker.weights.gguf_header import GGUFHeader, hybrid_config

    ref = make_tiny_llama(root / "reference", seed=seed, family=family, **overrides)
    cfg = json.loads((ref / "config.json").read_text())
    state = load_file(str(ref / "model.safetensors"))
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, dv = 2 * k_heads * cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def order(d: int) -> torch.Tensor:  # grouped index of each tiled position, heads of d values
        return torch.arange(v_heads * d).view(k_heads, v_heads // k_heads, d).transpose(0, 1)

    def tile(t: torch.Tensor, dim: int, d: int, start: int = 0) -> torch.Tensor:
        idx = torch.cat([torch.arange(start), start + order(d).reshape(-1)])
        return t.index_select(dim, idx)

    def untile(t: torch.Tensor, dim: int, d: int, start: int = 0) -> torch.Tensor:
        idx = torch.cat([torch.arange(start), start + order(d).reshape(-1)])
        return t.index_select(dim, torch.argsort(idx))

    q8 = GGMLQuantizationType.Q8_0
    stored: dict[str, tuple[np.ndarray, bool]] = {}  # gguf name -> (values, quantized)
    held: dict[str, torch.Tensor] = {}  # hf name -> what the file holds, in transformers' order

    def put(gname: str, hf: str, t: torch.Tensor, back=lambda x: x) -> None:
        w = t.float().numpy()
        quantize = w.ndim >= 2 and w.shape[-1] % 32 == 0 and not gname.endswith("_inp.weight")
        if quantize:
            w = quants.dequantize(quants.quantize(w, q8), q8).reshape(w.shape)
        stored[gname] = (w, quantize)
        held[hf] = back(torch.from_numpy(np.ascontiguousarray(w)))

    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            put("token_embd.weight", name, t)
        elif name == "lm_head.weight":
            put("output.weight", name, t)
        elif name == "model.norm.weight":
            put("output_norm.weight", name, t + 1, lambda x: x - 1)
        elif parts[4] == "experts":  # model.layers.N.mlp.experts.E.proj.weight
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = t
        else:
            blk, rest = f"blk.{parts[2]}.", ".".join(parts[3:-1])
            if rest in NORMS:
                put(blk + NORMS[rest] + ".weight", name, t + 1, lambda x: x - 1)
            elif rest in MATRICES:
                put(blk + MATRICES[rest] + ".weight", name, t)
            else:
                _linear(put, blk, name, rest, t, tile, untile, key_dim, dv)
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        put(f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", f"{layer}.{proj}", stacked)
        for e in sorted(by_expert):
            held[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = held[f"{layer}.{proj}"][e]
        del held[f"{layer}.{proj}"]
    save_file(
        {k: v.contiguous() for k, v in held.items()},
        str(ref / "model.safetensors"),
        metadata={"format": "pt"},
    )

    served = root / "served"
    served.mkdir(parents=True, exist_ok=True)
    path = served / "tiny.Q8_0.gguf"
    arch = "qwen35moe" if "moe" in family else "qwen35"
    writer = GGUFWriter(str(path), arch)
    _header(writer, arch, cfg)
    for gname, (w, quantize) in stored.items():
        if quantize:
            writer.add_tensor(gname, quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gname, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ref / f, served / f)
    (served / "config.json").write_text(json.dumps(hybrid_config(GGUFHeader(path))))
    (served / "pagedserve_model.json").write_text(json.dumps({"gguf": str(path)}))
    return served, ref


def _linear(put, blk, name, rest, t, tile, untile, key_dim, dv) -> None:
    """A Gated DeltaNet tensor in llama.cpp's form: value heads tiled, A negated and exponentiated,
    the conv squeezed."""
    import torch

    if rest == "linear_attn.in_proj_qkv":
        put(
            blk + "attn_qkv.weight",
            name,
            tile(t, 0, dv, key_dim),
            lambda x: untile(x, 0, dv, key_dim),
        )
    elif rest == "linear_attn.in_proj_z":
        put(blk + "attn_gate.weight", name, tile(t, 0, dv), lambda x: untile(x, 0, dv))
    elif rest in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
        gname = "ssm_alpha" if rest.endswith("_a") else "ssm_beta"
        put(f"{blk}{gname}.weight", name, tile(t, 0, 1), lambda x: untile(x, 0, 1))
    elif rest == "linear_attn.out_proj":
        put(blk + "ssm_out.weight", name, tile(t, 1, dv), lambda x: untile(x, 1, dv))
    elif rest == "linear_attn.conv1d":
        squeezed = tile(t.squeeze(1), 0, dv, key_dim)
        put(blk + "ssm_conv1d.weight", name, squeezed, lambda x: untile(x, 0, dv, key_dim)[:, None])
    elif rest == "linear_attn.norm":
        put(blk + "ssm_norm.weight", name, t)
    elif name.endswith("A_log"):
        a = -torch.exp(tile(t, 0, 1))
        put(blk + "ssm_a", name, a, lambda x: untile(torch.log(-x), 0, 1))
    elif name.endswith("dt_bias"):
        put(blk + "ssm_dt.bias", name, tile(t, 0, 1), lambda x: untile(x, 0, 1))
    else:
        raise KeyError(f"{name} has no place in a qwen35 file")


def _header(writer, arch: str, cfg: dict) -> None:
    """The keys llama.cpp's converter writes for these architectures."""
    head_dim = cfg["head_dim"]
    w = writer
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg.get("intermediate_size", 0))
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", 0.25)
    w.add_uint32(f"{arch}.rope.dimension_count", int(head_dim * partial))
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg["linear_num_value_heads"])
    inner = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    w.add_uint32(f"{arch}.ssm.inner_size", inner)
    kinds = [t == "linear_attention" for t in cfg["layer_types"]]
    w.add_array(f"{arch}.attention.recurrent_layers", kinds)
    if arch == "qwen35moe":
        w.add_uint32(f"{arch}.expert_count", cfg["num_experts"])
        w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        w.add_uint32(
            f"{arch}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"]
        )
