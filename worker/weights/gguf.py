"""A GGUF's tensors read straight from the file by Hugging Face names, no fp32 copy. Unmapped
architectures go through transformers (deploy/prepare_model.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from worker.model.quant_weights import QUANT_TYPES
from worker.weights.checkpoint import DEFAULT_LAYER_NAMES, Range, TensorSource, range_index
from worker.weights.gguf_families import ARCHS as FAMILY_ARCHS
from worker.weights.gguf_families import undo
from worker.weights.gguf_header import (
    HYBRID_ARCHS,
    NATIVE_ARCHS,
    PERMUTED_ARCHS,
    GGUFHeader,
    hf_names,
)

# a qwen35 file's norms hold 1 + w (llama.cpp adds the one Qwen3.5's norms multiply by)
OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "model.norm.weight",
)


def rope_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """Hugging Face row h*hd + half*hd/2 + i is GGUF row h*hd + 2*i + half (llama.cpp's permute)."""
    h = torch.arange(n_heads).view(-1, 1, 1)
    half = torch.arange(2).view(1, -1, 1)
    i = torch.arange(head_dim // 2).view(1, 1, -1)
    return (h * head_dim + 2 * i + half).reshape(-1)


class GGUFFile(GGUFHeader):
    """A GGUF read with plain reads: a memory map's pages would count twice in resident memory."""

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Rows first, as torch holds it (ggml lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def read(self, name: str, first: int = 0, count: int | None = None) -> torch.Tensor:
        """The tensor's stored bytes, uint8 [rows, bytes a row]; with `count`, rows first .. first +
        count of its innermost rows (a stacked expert's) and no others.
        """
        t = self.tensors[name]
        shape = self.shape(name)
        rows = shape[0] if len(shape) > 1 else 1
        if count is not None:
            rows = count
            inner = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            row_bytes = int(t.n_bytes) // inner
            start, size = first * row_bytes, count * row_bytes
        else:
            start, size = 0, int(t.n_bytes)
        out = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:]], int(t.data_offset) + start + done)
                if n <= 0:
                    raise OSError(f"{self.path.name} ends inside tensor {name}")
                done += n
        return out.view(rows, -1)

    def dequantize(self, name: str) -> torch.Tensor:
        """fp32 in torch's shape, by the native kernels where they serve the type."""
        from gguf import GGMLQuantizationType, quants

        shape, qtype = self.shape(name), self.type_name(name)
        raw = self.read(name)
        if qtype == "F32":
            return raw.view(-1).view(torch.float32).view(shape).clone()
        if qtype == "F16":
            return raw.view(-1).view(torch.float16).view(shape).float()
        if qtype == "BF16":
            return raw.view(-1).view(torch.bfloat16).view(shape).float()
        if qtype in QUANT_TYPES and len(shape) == 2:
            from kernels import cpu_native

            kernels = cpu_native.load()
            if kernels is not None:
                out = torch.empty(shape)
                kernels.quant_dequant(raw, QUANT_TYPES[qtype][0], shape[0], shape[1], out)
                return out
        values = quants.dequantize(raw.numpy(), GGMLQuantizationType[qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape)


class GGUFTensorSource(TensorSource):
    """A GGUF as a checkpoint: dense tensors dequantized one at a time, q/k rows in HF order."""

    def __init__(self, path: str | Path, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        self.file = GGUFFile(path)
        names = hf_names(self.file)
        if names is None:
            raise ValueError(
                f"{self.file.path.name}: a {self.file.arch!r} GGUF is not read directly "
                f"(this reader maps {', '.join(NATIVE_ARCHS)})"
            )
        self._names = names
        # stacked experts ([experts, rows, cols]) by expert: {hf name: (file's name, expert)}
        self._experts: dict[str, tuple[str, int]] = {}
        for hf, gguf in list(names.items()):
            if ".mlp.experts." in hf and not hf.endswith((".weight", "_bias")):
                del names[hf]
                prefix, proj = hf.rsplit(".experts.", 1)
                for e in range(self.file.shape(gguf)[0]):
                    self._experts[f"{prefix}.experts.{e}.{proj}.weight"] = (gguf, e)
        self._stack: tuple[str, torch.Tensor] | None = None  # the last stack read, for its experts
        self.hybrid = self.file.arch in HYBRID_ARCHS
        # the late-2026 families' files: read by the names every family's checkpoint is
        self.family = self.file.arch in FAMILY_ARCHS
        self.layer_names = DEFAULT_LAYER_NAMES if self.family else None
        self._perm = {}
        if self.file.arch in PERMUTED_ARCHS:
            self._perm = {
                "self_attn.q_proj.weight": rope_rows(n_heads, head_dim),
                "self_attn.k_proj.weight": rope_rows(n_kv_heads, head_dim),
            }

    def names(self) -> set[str]:
        return set(self._names) | set(self._experts)

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        if name in self._experts:
            stacked, e = self._experts[name]
            if self._stack is None or self._stack[0] != stacked:
                self._stack = (stacked, self.file.dequantize(stacked))
            t = self._stack[1][e]
            return t[range_index(rows, cols)] if rows is not None or cols is not None else t
        t = self.file.dequantize(self._names[name])
        if self.hybrid:
            t = _hybrid_tensor(name, t)
        elif self.family:
            t = undo(name, t, self.file.arch)
        perm = next((p for suffix, p in self._perm.items() if name.endswith(suffix)), None)
        if perm is not None:
            t = t[perm]
        return t[range_index(rows, cols)] if rows is not None or cols is not None else t


def _hybrid_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """A qwen35 tensor as the HF checkpoint holds it (norms less one, A_log, gate as a row)."""
    if name.endswith(OFFSET_NORMS):
        return t - 1.0
    if name.endswith("linear_attn.A_log"):
        return torch.log(-t)
    if name.endswith("shared_expert_gate.weight"):
        return t.reshape(1, -1)
    return t
