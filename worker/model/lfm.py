"""LFM2's and LFM2-MoE's config.json read into LFM3's fields (worker/model/families.py reads every
LFM as LFM3): the same gated short convs beside attention, without LFM3's head gate or its norms
after each block.
"""

from __future__ import annotations


def lfm2_config(cfg: dict) -> dict:
    """LFM2's config in LFM3's fields: its attention layers from full_attn_idxs where layer_types is
    absent, no head gate, no norms after the blocks, one RoPE. LFM2's MLP is as wide as its
    block_auto_adjust_ff_dim sizes it (2/3 of block_ff_dim, times the multiplier, rounded up to
    block_multiple_of), as transformers and llama.cpp size it; LFM2-MoE's dense leading layers are
    intermediate_size wide, every later MLP experts (a sigmoid router, renormalized by default).
    """
    layers = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if not types:
        full = cfg.get("full_attn_idxs")
        full = range(layers) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    out = {
        **cfg,
        "layer_types": list(types),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True)),
        "use_attention_gate": False,
        "use_sandwich_norm": False,
    }
    if cfg.get("model_type") == "lfm2_moe":
        dense = int(cfg.get("num_dense_layers", 2))
        out["mlp_only_layers"] = list(range(min(dense, layers)))
        out["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", True))
        return out
    width = int(cfg.get("block_ff_dim") or cfg.get("intermediate_size") or 0)
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            width = int(float(cfg["block_ffn_dim_multiplier"]) * width)
            multiple = int(cfg.get("block_multiple_of") or 256)
            width = multiple * ((width + multiple - 1) // multiple)
    return {**out, "intermediate_size": width}
