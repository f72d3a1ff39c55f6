"""gpt-oss's MXFP4 experts as its Hugging Face checkpoint ships them (`*_blocks`, `*_scales`):
served as ggml MXFP4 blocks by the native kernels (`MXFP4Source`), or dequantized where they are
not (a GPU, --dequantize).
"""

from __future__ import annotations

import math

import torch

from worker.model.quant_weights import QuantWeight
from worker.weights.checkpoint import TensorSource

# E2M1's sixteen values: the checkpoint's scale is 2^(e - 127)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
PROJECTIONS = ("gate_up_proj", "down_proj")


def is_mxfp4(cfg: dict) -> bool:
    return (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n, 16] nibbles (value 2j low, 2j + 1 high) and [..., n] E8M0 scales -> ggml's
    block_mxfp4 rows [..., n * 17]: the scale, then value j low and value j + 16 high.
    """
    values = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., n, 32]
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).contiguous()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., n * 32] of the checkpoint's blocks."""
    table = torch.tensor(FP4_VALUES)
    values = torch.stack([table[(blocks & 15).long()], table[(blocks >> 4).long()]], dim=-1)
    scale = torch.exp2(scales.float() - 127.0)
    return (values.flatten(-2) * scale.unsqueeze(-1)).flatten(-2)


class MXFP4Source:
    """A gpt-oss folder's experts by expert as MXFP4 QuantWeights (model.layers.N.mlp.experts.E.
    {gate,up,down}_proj.weight; gate and up are the checkpoint's alternate rows); every other matrix
    stays with the checkpoint, dense.
    """

    def __init__(self, checkpoint: TensorSource, config) -> None:
        self.checkpoint = checkpoint
        self.config = config
        self.description = "its MXFP4 experts on their blocks"

    def qtype(self, hf_name: str) -> str | None:
        return "MXFP4" if self._where(hf_name) is not None else None

    def _where(self, hf_name: str) -> tuple[str, int, slice] | None:
        """(the stacked tensor's prefix, expert, its rows there) of one expert's matrix."""
        parts = hf_name.split(".")
        if parts[3:5] != ["mlp", "experts"] or len(parts) != 8:
            return None
        proj = "down_proj" if parts[6] == "down_proj" else "gate_up_proj"
        prefix = ".".join(parts[:5]) + f".{proj}"
        if prefix + "_blocks" not in self.checkpoint.names():
            return None
        rows = slice(None) if proj == "down_proj" else slice(parts[6] == "up_proj", None, 2)
        return prefix, int(parts[5]), rows

    def get(
        self, hf_name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> QuantWeight:
        where = self._where(hf_name)
        if where is None:
            raise KeyError(f"{hf_name} is not an MXFP4 expert of this checkpoint")
        prefix, e, own = where
        blocks = self.checkpoint.get(prefix + "_blocks", (e, e + 1))[0][own]
        scales = self.checkpoint.get(prefix + "_scales", (e, e + 1))[0][own]
        if rows is not None:
            blocks, scales = blocks[rows[0] : rows[1]], scales[rows[0] : rows[1]]
        if cols is not None:  # whole 32-value blocks
            if cols[0] % 32 or cols[1] % 32:
                raise ValueError(f"{hf_name}: columns {cols} do not fall on 32-value blocks")
            blocks, scales = (
                blocks[:, cols[0] // 32 : cols[1] // 32],
                scales[:, cols[0] // 32 : cols[1] // 32],
            )
        return QuantWeight(to_ggml(blocks, scales), "MXFP4", blocks.shape[1] * 32)

    def held_bytes(self, tied: bool) -> int:
        """The experts' blocks as stored (a byte each), every other tensor fp32, a tied table
        twice.
        """
        held = 0
        for name in self.checkpoint.names():
            count = math.prod(self.checkpoint.shape(name))
            held += count if name.endswith(("_blocks", "_scales")) else 4 * count
        c = self.config
        return held + (4 * c.vocab_size * c.hidden_size if tied else 0)
