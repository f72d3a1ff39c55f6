"""Matrices served from their file's blocks: a GGUF's (`GGUFQuantSource`) or a checkpoint's cast to
bf16 (`CastSource`). llama.cpp's interleaved q/k rows are put back in Hugging Face order (a row
permutation).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model.quant_weights import QUANT_TYPES, QuantWeight
from worker.weights.gguf import GGUFFile


class CastSource:
    """A checkpoint's matrices as bf16 rows for the native kernels; the rest fp32."""

    MATRICES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")

    def __init__(self, checkpoint, config, qtype: str = "BF16") -> None:
        self.checkpoint = checkpoint
        self.config = config
        self.qtype_name = qtype
        self.dtype = {"BF16": torch.bfloat16, "F16": torch.float16}[qtype]
        self.description = f"{qtype.lower()} weights"

    def _name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" and hf_name not in self.checkpoint:
            hf_name = "model.embed_tokens.weight"  # tied
        return hf_name if hf_name in self.checkpoint and hf_name.endswith(self.MATRICES) else None

    def qtype(self, hf_name: str) -> str | None:
        return self.qtype_name if self._name(hf_name) is not None else None

    def get(
        self, hf_name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> QuantWeight:
        t = self.checkpoint.get(self._name(hf_name), rows, cols).to(self.dtype).contiguous()
        if t.dim() != 2 or t.shape[1] % 32:
            raise ValueError(f"{hf_name}: {tuple(t.shape)} is not rows of whole 32-value blocks")
        return QuantWeight(t.view(torch.uint8), self.qtype_name, t.shape[1])

    def held_bytes(self, tied: bool) -> int:
        """Two bytes a value, a tied table twice."""
        from worker.model.layer_kinds import parameter_count

        c = self.config
        return 2 * (parameter_count(c) + (c.vocab_size * c.hidden_size if tied else 0))


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF a model comes from (itself, or the file
    its pagedserve_model.json names); else None.
    """
    path = Path(model)
    if path.suffix == ".gguf":
        return path if path.is_file() else None
    meta = path / "pagedserve_model.json"
    if not meta.is_file():
        return None
    info = json.loads(meta.read_text())
    if info.get("gguf") and Path(info["gguf"]).is_file():
        return Path(info["gguf"])
    if info.get("source"):
        from worker.weights.gguf_header import find_embedded_gguf

        try:
            return find_embedded_gguf(name=info["source"])
        except FileNotFoundError:
            return None
    return None


class GGUFQuantSource:
    """A GGUF's quantized matrices by Hugging Face name; stacked tensors (Phi-3's attn_qkv) give
    their rows.
    """

    LAYER = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        # a qwen35 file's Gated DeltaNet projections, and a qwen35moe file's shared expert
        "linear_attn.in_proj_qkv": "attn_qkv",
        "linear_attn.in_proj_z": "attn_gate",
        "linear_attn.in_proj_b": "ssm_beta",
        "linear_attn.in_proj_a": "ssm_alpha",
        "linear_attn.in_proj_ba": "ssm_ba",  # Qwen3-Next's, by key head
        "linear_attn.out_proj": "ssm_out",
        # Mamba2's (Granite 4, Nemotron-H, Falcon-H1)
        "mamba.in_proj": "ssm_in",
        "mamba.out_proj": "ssm_out",
        # LFM2's short convs
        "conv.in_proj": "shortconv.in_proj",
        "conv.out_proj": "shortconv.out_proj",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
    }

    def __init__(self, path: str | Path, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        from worker.weights.gguf import rope_rows
        from worker.weights.gguf_header import PERMUTED_ARCHS

        self.file = GGUFFile(path)
        self.path = self.file.path
        self.description = f"{self.path.name} on its own blocks"
        self.arch = self.file.arch
        self._tensors = self.file.tensors
        self._perm = {
            "attn_q": rope_rows(n_heads, head_dim),
            "attn_k": rope_rows(n_kv_heads, head_dim),
        }
        self._permute = self.arch in PERMUTED_ARCHS
        self._q_rows, self._kv_rows = n_heads * head_dim, n_kv_heads * head_dim

    def held_bytes(self, tied: bool) -> int:
        """Served blocks (packed: up to 6% more), other tensors fp32, a tied table twice."""
        held = 0
        for t in self._tensors.values():
            quantized = t.tensor_type.name in QUANT_TYPES
            held += int(t.n_bytes) * 106 // 100 if quantized else 4 * int(t.n_elements)
        embd = self._tensors.get("token_embd.weight")
        if (
            tied
            and embd is not None
            and "output.weight" not in self._tensors
            and embd.tensor_type.name in QUANT_TYPES
        ):
            held += int(embd.n_bytes)
        return held

    def _locate(self, hf_name: str) -> tuple[str, int, int | None]:
        """(the file's tensor holding the matrix, first row, rows or None: all)."""
        parts = hf_name.split(".")
        if parts[3:5] == ["mlp", "experts"] and len(parts) == 8:  # one expert of a stacked tensor
            proj = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps"}.get(parts[6])
            name = f"blk.{parts[2]}.{proj or 'ffn_down_exps'}.weight"
            if name not in self._tensors:
                raise KeyError(f"{hf_name} has no quantized matrix in {self.path.name}")
            rows = int(self._tensors[name].shape[1])  # ggml: [in, rows, experts]
            return name, int(parts[5]) * rows, rows
        name = self.gguf_name(hf_name)
        prefix, kind = name.rsplit(".", 2)[0], name.split(".")[-2]
        qkv = f"{prefix}.attn_qkv.weight"
        if (
            kind in ("attn_q", "attn_k", "attn_v")
            and name not in self._tensors
            and qkv in self._tensors
        ):
            q, kv = self._q_rows, self._kv_rows
            return (
                qkv,
                {"attn_q": 0, "attn_k": q, "attn_v": q + kv}[kind],
                q if kind == "attn_q" else kv,
            )
        up = f"{prefix}.ffn_up.weight"
        if (  # Phi-3's ffn_up holds gate then up (Nemotron-H's up alone is up)
            self.arch == "phi3"
            and kind in ("ffn_gate", "ffn_up")
            and f"{prefix}.ffn_gate.weight" not in self._tensors
            and up in self._tensors
        ):
            half = int(self._tensors[up].shape[1]) // 2  # gate's rows, then up's
            return up, 0 if kind == "ffn_gate" else half, half
        return name, 0, None

    def gguf_name(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight":
            return "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        if hf_name == "model.embed_tokens.weight":
            return "token_embd.weight"
        parts = hf_name.split(".")
        if parts[:2] == ["model", "layers"] and parts[-1] == "weight":
            key = ".".join(parts[3:-1])
            if key in self.LAYER:
                return f"blk.{parts[2]}.{self.LAYER[key]}.weight"
        raise KeyError(f"{hf_name} has no quantized matrix in {self.path.name}")

    def qtype(self, hf_name: str) -> str | None:
        """A matrix's quantization, or None where the kernels do not serve it."""
        try:
            name = self._locate(hf_name)[0]
        except KeyError:  # a matrix this reader does not map (a hybrid's linear layers): dense
            return None
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{hf_name} ({name}) is missing from {self.path.name}")
        return t.tensor_type.name if t.tensor_type.name in QUANT_TYPES else None

    def get(
        self, hf_name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> QuantWeight:
        name, first, count = self._locate(hf_name)
        t = self._tensors[name]
        qtype = t.tensor_type.name
        if qtype not in QUANT_TYPES:
            raise ValueError(
                f"{name} is {qtype}; the quantized kernels serve {', '.join(QUANT_TYPES)}"
            )
        in_dim = int(t.shape[0])  # ggml lists dimensions innermost first
        kind = name.split(".")[-2]
        if count is not None:  # this matrix's rows of a stacked tensor
            rows = (first + (rows or (0, count))[0], first + (rows or (0, count))[1])
        if rows is not None and not (self._permute and kind in self._perm):
            # only these rows are read (an expert of a stacked tensor, a rank's share), not mapped
            w = QuantWeight(self.file.read(name, rows[0], rows[1] - rows[0]), qtype, in_dim)
        else:
            w = QuantWeight(self.file.read(name), qtype, in_dim)
            if self._permute and kind in self._perm:
                w = w.rows(self._perm[kind])
            if rows is not None:
                w = w.rows(slice(*rows))
        if cols is not None:
            w = w.cols(*cols)
        return w
