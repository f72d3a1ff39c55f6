"""A GGUF file's tensors read straight from the file, by their Hugging Face names: no fp32 copy of the model.
A file of an architecture whose tensors are not mapped here (`NATIVE_ARCHS`) is prepared through
transformers instead (deploy/prepare_model.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from worker.model.quantized import QUANT_TYPES
from worker.weights.checkpoint import Range, TensorSource, range_index
from worker.weights.gguf_header import NATIVE_ARCHS, PERMUTED_ARCHS, GGUFHeader, hf_names


def rope_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """For Hugging Face row h*hd + half*hd/2 + i, the GGUF row h*hd + 2*i + half (llama.cpp's permute)."""
    h = torch.arange(n_heads).view(-1, 1, 1)
    half = torch.arange(2).view(1, -1, 1)
    i = torch.arange(head_dim // 2).view(1, 1, -1)
    return (h * head_dim + 2 * i + half).reshape(-1)


class GGUFFile(GGUFHeader):
    """Plain reads, not a memory map: the mapped pages of a 5 GB file would count in the worker's resident
    memory beside its own copy of the blocks.

    A GGUF's header (architecture, tensor table) and its tensors' bytes, read on demand."""

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Rows first, as torch holds it (ggml lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def read(self, name: str) -> torch.Tensor:
        """The tensor's bytes as stored, uint8 [rows, bytes a row], read into memory this process owns."""
        t = self.tensors[name]
        out = torch.empty(int(t.n_bytes), dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:]], int(t.data_offset) + done)
                if n <= 0:
                    raise OSError(f"{self.path.name} ends inside tensor {name}")
                done += n
        rows = self.shape(name)[0] if len(t.shape) > 1 else 1
        return out.view(rows, -1)

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as fp32 in torch's shape: the native kernels where they serve its type, else gguf's
        own."""
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
    """A checkpoint (weights/checkpoint.py's interface): norms, biases and any matrix served dense are
    dequantized one tensor at a time as the model loads it (llama.cpp's permuted query/key rows put back
    in Hugging Face's order); the matrices served on their own blocks are never read here
    (weights/gguf_blocks.py reads those).

    A GGUF file as a Hugging Face checkpoint: each tensor dequantized to fp32 when it is asked for."""

    def __init__(self, path: str | Path, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        self.file = GGUFFile(path)
        names = hf_names(self.file)
        if names is None:
            raise ValueError(f"{self.file.path.name}: a {self.file.arch!r} GGUF is not read directly "
                             f"(this reader maps {', '.join(NATIVE_ARCHS)})")
        self._names = names
        self._perm = {}
        if self.file.arch in PERMUTED_ARCHS:
            self._perm = {"self_attn.q_proj.weight": rope_rows(n_heads, head_dim),
                          "self_attn.k_proj.weight": rope_rows(n_kv_heads, head_dim)}

    def names(self) -> set[str]:
        return set(self._names)

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        t = self.file.dequantize(self._names[name])
        perm = next((p for suffix, p in self._perm.items() if name.endswith(suffix)), None)
        if perm is not None:
            t = t[perm]
        return t[range_index(rows, cols)] if rows is not None or cols is not None else t
