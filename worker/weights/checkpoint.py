"""Checkpoint tensors by name, read a slice at a time: a TP rank reads only its rows or columns,
lazily from safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

Range = tuple[int, int] | None


class TensorSource:
    """Hugging Face-named tensors; `get` slices rows and/or columns."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.names()


def range_index(rows: Range, cols: Range) -> tuple[slice, ...]:
    r = slice(*rows) if rows else slice(None)
    return (r,) if cols is None else (r, slice(*cols))


class DictSource(TensorSource):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name, rows=None, cols=None):
        return self.tensors[name][range_index(rows, cols)]


class SafetensorsSource(TensorSource):
    """A folder of safetensors files (sharded with model.safetensors.index.json, or not)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {folder}")
        self._handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self._file_of = {name: h for h in self._handles for name in h.keys()}

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name, rows=None, cols=None):
        if rows is None and cols is None:
            return self._file_of[name].get_tensor(name)
        return self._file_of[name].get_slice(name)[range_index(rows, cols)]

    def shape(self, name: str) -> list[int]:
        return self._file_of[name].get_slice(name).get_shape()


class BareDecoderSource(TensorSource):
    """A decoder saved without its head (as embedding models ship), renamed as the model reads."""

    PREFIX = "model."

    def __init__(self, inner: TensorSource) -> None:
        self.inner = inner

    @classmethod
    def wrap(cls, source: TensorSource) -> TensorSource:
        """source itself, or its bare decoder's tensors under `model.` where
        that is what it holds.
        """
        names = source.names()
        bare = "embed_tokens.weight" in names and not any(n.startswith(cls.PREFIX) for n in names)
        return cls(source) if bare else source

    def names(self) -> set[str]:
        return {self.PREFIX + n for n in self.inner.names()}

    def get(self, name, rows=None, cols=None):
        if not name.startswith(self.PREFIX):
            raise KeyError(name)
        return self.inner.get(name[len(self.PREFIX) :], rows, cols)


class LanguageModelSource(TensorSource):
    """A multimodal checkpoint's language model as text; vision and MTP tensors are not read."""

    INNER = "model.language_model."
    # Qwen3.5's vision tower and MTP head; Gemma 4's vision and audio towers and their embedders
    SKIPPED = ("model.visual.", "mtp.", "model.vision_tower.", "model.audio_tower.")
    SKIPPED += ("model.embed_vision.", "model.embed_audio.")

    def __init__(self, inner: TensorSource) -> None:
        self.inner = inner

    @classmethod
    def wrap(cls, source: TensorSource) -> TensorSource:
        names = source.names()
        return (
            cls(source) if any(n.startswith((cls.INNER, *cls.SKIPPED)) for n in names) else source
        )

    @property
    def skipped(self) -> int:
        """Tensors left unread (the vision tower's, the MTP head's)."""
        return sum(n.startswith(self.SKIPPED) for n in self.inner.names())

    def names(self) -> set[str]:
        return {
            "model." + n[len(self.INNER) :] if n.startswith(self.INNER) else n
            for n in self.inner.names()
            if not n.startswith(self.SKIPPED)
        }

    def get(self, name, rows=None, cols=None):
        inner = self.INNER + name[len("model.") :] if name.startswith("model.") else name
        if inner not in self.inner.names():
            inner = name
        return self.inner.get(inner, rows, cols)


@dataclass(frozen=True)
class LayerNames:
    """Where a family's checkpoint keeps a decoder layer's tensors, under `model.layers.{i}.`."""

    moe: str = "mlp."  # the mixture-of-experts block: its router `gate.weight`, `experts.{e}.`
    router: str = "gate.weight"
    correction: str = "e_score_correction_bias"  # a sigmoid router's bias, to choose by
    fused_experts: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")  # [E, 2I, H]
    # the shared expert beside them: its gate and up in one tensor, its down
    shared: tuple[str, str, str] = ("mlp.shared_expert.", "gate_up_proj.weight", "down_proj.weight")
    mlp: str = "mlp."  # the dense MLP: its gate, up, down
    dense: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    input_norm: str = "input_layernorm"
    post_attention: str = "post_attention_layernorm"  # before the MLP (without sandwich norms)
    final_norm: str = "model.norm.weight"
    # an expert's gate, up, down
    expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    qkv: str = "self_attn.qkv_proj"  # q, k and v as one tensor (Phi-3), where the checkpoint has it
    gate_up: str = "mlp.gate_up_proj.weight"  # gate then up as one tensor (Phi-3), where present
    # attention's output projection and its per-head q and k norms, under self_attn.
    attention: tuple[str, str, str] = ("o_proj", "q_norm", "k_norm")
    # Gemma's four norms a layer: on the attention output, before and after the MLP
    sandwich: tuple[str, str, str] = (
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )


LAYER_NAMES = {"mixtral": LayerNames(moe="block_sparse_moe.", expert=("w1", "w3", "w2"))}
LAYER_NAMES["minimax_m2"] = LAYER_NAMES["mixtral"]
LAYER_NAMES["granitemoehybrid"] = LayerNames(
    moe="block_sparse_moe.",
    router="router.layer.weight",
    fused_experts=("input_linear.weight", "output_linear.weight"),
    shared=("shared_mlp.", "input_linear.weight", "output_linear.weight"),
    mlp="shared_mlp.",
    gate_up="shared_mlp.input_linear.weight",
    dense=("", "", "output_linear"),
)
LAYER_NAMES["falcon_h1"] = LayerNames(
    mlp="feed_forward.",
    post_attention="pre_ff_layernorm",
    final_norm="model.final_layernorm.weight",
)
LAYER_NAMES["lfm3"] = LayerNames(
    mlp="feed_forward.",
    dense=("w1", "w3", "w2"),
    input_norm="operator_norm",
    post_attention="ffn_norm",
    sandwich=("post_operator_norm", "ffn_norm", "post_ffn_norm"),
    final_norm="model.embedding_norm.weight",
)
# LFM2: LFM3's names but attention's, and no norms after the blocks
LAYER_NAMES["lfm2"] = LayerNames(
    mlp="feed_forward.",
    dense=("w1", "w3", "w2"),
    input_norm="operator_norm",
    post_attention="ffn_norm",
    final_norm="model.embedding_norm.weight",
    attention=("out_proj", "q_layernorm", "k_layernorm"),
)
# LFM2-MoE: its experts under feed_forward. too, a correction bias of its own name
LAYER_NAMES["lfm2_moe"] = replace(
    LAYER_NAMES["lfm2"], moe="feed_forward.", expert=("w1", "w3", "w2"), correction="expert_bias"
)
DEFAULT_LAYER_NAMES = LayerNames()


class CheckpointReader:
    """One rank's reads, remembered so every parameter is covered and every tensor used."""

    def __init__(self, source: TensorSource, dtype: torch.dtype, norm_offset: float) -> None:
        self.source, self.dtype, self.norm_offset = source, dtype, norm_offset
        self.loaded: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def take(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        if name not in self.source:
            raise KeyError(f"weight {name} is missing from the checkpoint")
        self.loaded.add(name)
        return self.source.get(name, rows, cols).to(self.dtype)

    def take_raw(self, name: str) -> torch.Tensor:
        """A tensor as stored (MXFP4's uint8 blocks and scales), not cast."""
        if name not in self.source:
            raise KeyError(f"weight {name} is missing from the checkpoint")
        self.loaded.add(name)
        return self.source.get(name)

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight as the model multiplies by it (Gemma's scales by 1 + weight)."""
        return self.take(name) + self.norm_offset

    def vocab_rows(self, name: str, rows: tuple[int, int], shard_size: int) -> torch.Tensor:
        t = self.take(name, rows)
        return F.pad(t, (0, 0, 0, shard_size - t.shape[0]))  # the last shard may be short

    def served(self, param, *names: str) -> bool:
        """A parameter released for the file's blocks (model.release): its tensors count as used,
        unread.
        """
        if param is None or param.numel():
            return False
        self.loaded.update(names)
        return True

    def check_all_used(self, tied_embeddings: bool) -> None:
        ignored = {n for n in self.source.names() if n not in self.loaded and "rotary_emb" not in n}
        if tied_embeddings:
            ignored.discard("lm_head.weight")
        if ignored:
            raise KeyError(f"checkpoint has weights this model does not use: {sorted(ignored)[:5]}")
