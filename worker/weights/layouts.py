"""Families whose checkpoints lay tensors out otherwise, read under the names the model loads by:
Qwen3-Next's fused Gated DeltaNet projections split, OLMo-Hybrid's separate ones stacked,
Nemotron-H's single-block layers renamed, Falcon-H1's multipliers folded into its weights.
"""

from __future__ import annotations

import torch

from worker.weights.checkpoint import TensorSource, range_index


class GroupedDeltaNetSource(TensorSource):
    """Qwen3-Next's Gated DeltaNet projections as Qwen3.5 names them: its `in_proj_qkvz` holds,
    for each key head in turn, that head's q and k rows, then its value heads' v rows, then their
    z rows; `in_proj_ba` each key head's value heads' b, then their a. Split here into `in_proj_qkv`
    (all q, all k, all v), `in_proj_z`, `in_proj_b`, `in_proj_a` (value heads in grouped order).
    """

    FUSED = {"in_proj_qkvz.weight": ("qkv", "z"), "in_proj_ba.weight": ("b", "a")}

    def __init__(self, inner: TensorSource, k_heads: int, v_heads: int, dk: int, dv: int) -> None:
        self.inner, self.k_heads, self.dk, self.dv = inner, k_heads, dk, dv
        self.ratio = v_heads // k_heads
        self.split = {}  # our name -> (the fused tensor's name, which part)
        for name in inner.names():
            for fused, parts in self.FUSED.items():
                if name.endswith(fused):
                    stem = name[: -len(fused)]
                    self.split.update({f"{stem}in_proj_{x}.weight": (name, x) for x in parts})

    @classmethod
    def wrap(cls, source: TensorSource, config) -> TensorSource:
        if config.model_type != "qwen3_next":
            return source
        c = config
        return cls(source, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)

    def names(self) -> set[str]:
        fused = {name for name, _ in self.split.values()}
        return (self.inner.names() - fused) | set(self.split)

    def get(self, name, rows=None, cols=None):
        if name not in self.split:
            return self.inner.get(name, rows, cols)
        fused, part = self.split[name]
        w = self.inner.get(fused)
        dk, dv, r = self.dk, self.dv, self.ratio
        if part in ("b", "a"):
            w = w.reshape(self.k_heads, 2 * r, -1)
            t = w[:, :r] if part == "b" else w[:, r:]
        else:
            w = w.reshape(self.k_heads, 2 * dk + 2 * r * dv, -1)
            if part == "z":
                t = w[:, 2 * dk + r * dv :]
            else:
                q, k, v = w[:, :dk], w[:, dk : 2 * dk], w[:, 2 * dk : 2 * dk + r * dv]
                t = torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v)])
        return t.reshape(-1, w.shape[-1])[range_index(rows, cols)]


class SplitDeltaNetSource(TensorSource):
    """OLMo-Hybrid's tensors as Qwen3.5 names them: its Gated DeltaNet's q, k and v projections
    (and their short convs, one each) stacked as `in_proj_qkv` (and `conv1d`), g, b, a, o and
    o_norm renamed; its blocks' norms (`attention_layer_norm`, `feedforward_layer_norm`) as
    `input_layernorm` and `post_attention_layernorm`.
    """

    STACKED = {
        "in_proj_qkv.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
        "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
    }
    RENAMED = {
        "in_proj_z.weight": "g_proj.weight",
        "in_proj_b.weight": "b_proj.weight",
        "in_proj_a.weight": "a_proj.weight",
        "out_proj.weight": "o_proj.weight",
        "norm.weight": "o_norm.weight",
        "input_layernorm.weight": "attention_layer_norm.weight",
        "post_attention_layernorm.weight": "feedforward_layer_norm.weight",
    }

    def __init__(self, inner: TensorSource) -> None:
        self.inner, self.parts = inner, {}  # our name -> the inner names it is read from
        names = inner.names()
        for name in names:
            stem, _, end = name.rpartition(".linear_attn.")
            for ours, theirs in self.STACKED.items():
                if (
                    stem
                    and end == theirs[0]
                    and all(f"{stem}.linear_attn.{t}" in names for t in theirs)
                ):
                    self.parts[f"{stem}.linear_attn.{ours}"] = [
                        f"{stem}.linear_attn.{t}" for t in theirs
                    ]
            for ours, theirs in self.RENAMED.items():
                base = name[: -len(theirs)]
                in_mixer = base.endswith(".linear_attn.") or not ours.startswith(
                    ("in_", "out", "norm")
                )
                if name.endswith("." + theirs) and in_mixer:
                    self.parts[base + ours] = [name]
        self.used = {t for parts in self.parts.values() for t in parts}

    @classmethod
    def wrap(cls, source: TensorSource, config) -> TensorSource:
        return cls(source) if config.model_type == "olmo_hybrid" else source

    def names(self) -> set[str]:
        return (self.inner.names() - self.used) | set(self.parts)

    def get(self, name, rows=None, cols=None):
        parts = self.parts.get(name)
        if parts is None:
            return self.inner.get(name, rows, cols)
        if len(parts) == 1:
            return self.inner.get(parts[0], rows, cols)
        return torch.cat([self.inner.get(p) for p in parts])[range_index(rows, cols)]


class ScaledSource(TensorSource):
    """Multipliers folded into the weights they scale, as they are read (Falcon-H1's µP): a name's
    end -> one scale, or (rows, scale) sections down its rows.
    """

    def __init__(self, inner: TensorSource, scales: dict) -> None:
        self.inner, self.scales = inner, scales

    @classmethod
    def wrap(cls, source: TensorSource, scales: dict) -> TensorSource:
        return cls(source, scales) if scales else source

    def names(self) -> set[str]:
        return self.inner.names()

    def get(self, name, rows=None, cols=None):
        t = self.inner.get(name, rows, cols)
        scale = next((s for end, s in self.scales.items() if name.endswith(end)), None)
        if scale is None:
            return t
        if isinstance(scale, (int, float)):
            return t * scale
        column = torch.cat([torch.full((n,), float(s)) for n, s in scale])
        return t * column[slice(*rows) if rows else slice(None)][:, None].to(t.dtype)


class BackboneSource(TensorSource):
    """Nemotron-H's tensors (`backbone.layers.{i}.mixer.*`, one block a layer) under the names the
    other families use: the block's norm before its mixer (`input_layernorm`) or its MLP
    (`post_attention_layernorm`), the mixer as `mamba.`, `self_attn.` or `mlp.`, the experts'
    shared MLP as `mlp.shared_expert.`.
    """

    PLACES = {"mamba": "mamba.", "attention": "self_attn.", "mlp": "mlp.", "moe": "mlp."}

    def __init__(self, inner: TensorSource, kinds: tuple[str, ...]) -> None:
        self.inner, self.kinds = inner, kinds
        self.ours = {self._rename(name): name for name in inner.names()}

    @classmethod
    def wrap(cls, source: TensorSource, kinds: tuple[str, ...]) -> TensorSource:
        return cls(source, kinds) if kinds else source

    def _rename(self, name: str) -> str:
        for prefix in ("backbone.", "model."):
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                break
        else:
            return name
        if rest == "embeddings.weight":
            return "model.embed_tokens.weight"
        if rest == "norm_f.weight":
            return "model.norm.weight"
        parts = rest.split(".", 3)
        if parts[0] != "layers" or len(parts) < 4:
            return "model." + rest
        layer, kind, where, tail = int(parts[1]), self.kinds[int(parts[1])], parts[2], parts[3]
        head = f"model.layers.{layer}."
        if where == "norm":
            ffn = kind in ("mlp", "moe")
            return head + ("post_attention_layernorm." if ffn else "input_layernorm.") + tail
        tail = tail.replace("shared_experts.", "shared_expert.").replace("gate.e_score", "e_score")
        return head + self.PLACES[kind] + tail

    def names(self) -> set[str]:
        return set(self.ours)

    def get(self, name, rows=None, cols=None):
        return self.inner.get(self.ours[name], rows, cols)
