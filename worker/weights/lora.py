"""A PEFT adapter's weights for this rank: A and B in the compute dtype, the scale folded into B,
split as the base is. The files' hash is checked again, so a rewritten folder never serves under the
old name.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from protos.codec import lora_identity
from worker.model.config import ModelConfig
from worker.model.lora import PROJECTIONS, LoraWeights, Projection
from worker.model.parallel import Shard

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Phi-3's fused names: each the parts it stacks
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _part_rows(config: ModelConfig, shard: Shard) -> dict[str, tuple[int, int, int]]:
    """Each output part's (lo, hi) rows this rank holds and their offset in its fused output."""
    hd = config.head_dim
    q = (shard.q_heads[0] * hd, shard.q_heads[1] * hd)
    kv = (shard.kv_heads[0] * hd, shard.kv_heads[1] * hd)
    inter = shard.intermediate
    q_local, kv_local = q[1] - q[0], kv[1] - kv[0]
    return {
        "q_proj": (*q, 0),
        "k_proj": (*kv, q_local),
        "v_proj": (*kv, q_local + kv_local),
        "gate_proj": (*inter, 0),
        "up_proj": (*inter, inter[1] - inter[0]),
        "o_proj": (0, config.hidden_size, 0),
        "down_proj": (0, config.hidden_size, 0),
    }


def _input_cols(config: ModelConfig, shard: Shard, part: str) -> slice:
    """A's columns this rank multiplies (row-parallel o_proj and down)."""
    if part == "o_proj":
        return slice(shard.q_heads[0] * config.head_dim, shard.q_heads[1] * config.head_dim)
    if part == "down_proj":
        return slice(*shard.intermediate)
    return slice(None)


def read_lora(
    folder: str | Path,
    identity: str,
    config: ModelConfig,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
) -> LoraWeights:
    """The adapter for this rank; ValueError if its files changed or it cannot be served."""

    # one function: a PEFT folder read in order: its config checked, then each tensor
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        found = lora_identity(folder)
    except OSError as e:
        raise ValueError(f"the LoRA adapter at {folder} cannot be read: {e.strerror or e}") from e
    if found != identity:
        raise ValueError(
            f"the LoRA adapter at {folder} changed on disk since it was loaded: load it again"
        )
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    rank = int(cfg["r"])
    if rank > max_rank:
        raise ValueError(
            f"the LoRA adapter at {folder} has rank {rank}, above --max-lora-rank {max_rank}"
        )
    scale = cfg.get("lora_alpha", rank) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(folder / WEIGHTS_FILE)).items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"the LoRA adapter at {folder} holds {key}, which is not served")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = t
    rows = _part_rows(config, shard)
    layers: list[dict[str, Projection]] = [{} for _ in range(config.num_layers)]
    for fused, parts in PROJECTIONS.items():
        for layer in range(config.num_layers):
            pieces = []  # (part, A [r, in], B [out_part_full, r])
            for name in (*parts, *(n for n, p in _FUSED.items() if p == parts)):
                ab = pairs.get((layer, name))
                if ab is None:
                    continue
                # its B split into its parts' rows (q, k, v or gate, up) of the full model
                if name in _FUSED:
                    sizes = {
                        "q_proj": config.num_heads * config.head_dim,
                        "k_proj": config.num_kv_heads * config.head_dim,
                        "v_proj": config.num_kv_heads * config.head_dim,
                        "gate_proj": config.intermediate_size,
                        "up_proj": config.intermediate_size,
                    }
                    bs = torch.split(ab["B"], [sizes[p] for p in _FUSED[name]])
                    pieces += [(p, ab["A"], b) for p, b in zip(_FUSED[name], bs, strict=True)]
                else:
                    pieces.append((name, ab["A"], ab["B"]))
            if not pieces:
                continue
            a_rows, placed, at = [], [], 0
            shared = {}  # a fused adapter's parts share one A: shrink once
            for part, a, b in pieces:
                lo, hi, offset = rows[part]
                if id(a) not in shared:
                    a_rows.append(a[:, _input_cols(config, shard, part)])
                    shared[id(a)] = (at, at + a.shape[0])
                    at += a.shape[0]
                placed.append((b[lo:hi], offset, offset + hi - lo, *shared[id(a)]))
            a_cat = torch.cat(a_rows).to(dtype).to(device).contiguous()
            bs = tuple((b.float() * scale).to(dtype).to(device).contiguous() for b, *_ in placed)
            spans = tuple((a_lo, a_hi, o_lo, o_hi) for _, o_lo, o_hi, a_lo, a_hi in placed)
            layers[layer][fused] = Projection(a_cat, bs, spans)
    return LoraWeights(identity, layers)


def lora_bytes(config: ModelConfig, shard: Shard, rank: int, itemsize: int) -> int:
    """One adapter's bytes on this rank: what each --max-cpu-loras slot sets aside."""
    rows = _part_rows(config, shard)
    per_layer = 0
    # A: each part's rank x its input; B: the parts' outputs x their ranks
    for parts in PROJECTIONS.values():
        a = sum(
            rank
            * (
                config.hidden_size
                if _input_cols(config, shard, p) == slice(None)
                else _input_cols(config, shard, p).stop - _input_cols(config, shard, p).start
            )
            for p in parts
        )
        per_layer += a + sum(rows[p][1] - rows[p][0] for p in parts) * rank
    return per_layer * config.num_layers * itemsize
