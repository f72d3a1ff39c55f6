"""A GGUF matrix as its blocks (`QuantWeight`, `QuantStack` of mixed types), the block types the
native kernels serve and their packed forms, and the layers that hold them (`QuantLinear`,
`QuantEmbedding`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml's type id, values a block and bytes a block of each type the kernels serve. Packed types (16
# rows interleaved, kernels/cpu/packed_blocks.h) are repacked at load and never sliced. Q5_0 / Q5_1
# are what K_M files hold where a row is not a multiple of 256 wide.
QUANT_TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "MXFP4": (39, 32, 17),  # gpt-oss's experts: E2M1 values, an E8M0 scale per 32
    "F16": (1, 32, 64),
    "BF16": (30, 32, 64),
}


PACKED_TYPES = {
    "Q4_x16": (100, 32, 20),
    "Q8_0_x16": (101, 32, 34),
    "Q4_K_x16": (102, 256, 152),
    "Q6_K_x16": (103, 256, 212),
    "Q5_K_x16": (104, 256, 184),
    "MXFP4_x16": (105, 32, 17),  # the nibbles as Q4_x16's, each looked up (E2M1) before its dot
    "Q5_x16": (106, 32, 24),  # Q4_x16's with a fifth bit a value
}


PACKED_FROM = {
    "Q4_0": "Q4_x16",
    "Q4_1": "Q4_x16",
    "Q5_0": "Q5_x16",
    "Q5_1": "Q5_x16",
    "Q8_0": "Q8_0_x16",
    "Q4_K": "Q4_K_x16",
    "Q5_K": "Q5_K_x16",
    "Q6_K": "Q6_K_x16",
    "MXFP4": "MXFP4_x16",
}


@dataclass
class QuantWeight:
    """A matrix as its GGUF blocks; a TP rank takes rows, or columns in whole 32-value blocks."""

    data: torch.Tensor  # uint8 [out_dim, in_dim / 32 * block_bytes], contiguous
    qtype: str
    in_dim: int
    origin: str = ""  # a packed weight's type in the file
    # a BF16 weight in oneDNN's blocked layout (QuantizedMatmul.hold_gemm)
    gemm: torch.Tensor | None = None

    @property
    def file_qtype(self) -> str:
        return self.origin or self.qtype

    @property
    def out_dim(self) -> int:
        return self.data.shape[0]

    @property
    def type_id(self) -> int:
        return (QUANT_TYPES.get(self.qtype) or PACKED_TYPES[self.qtype])[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_dim, self.in_dim)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _sliceable(self) -> None:
        if self.qtype in PACKED_TYPES:
            raise ValueError(
                f"a {self.qtype} weight has its rows interleaved: slice the blocks before packing"
            )

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        self._sliceable()
        return QuantWeight(self.data[index].contiguous(), self.qtype, self.in_dim)

    def cols(self, start: int, stop: int) -> QuantWeight:
        """Columns [start, stop) — whole blocks only (a tensor-parallel split of the input
        dimension).
        """
        self._sliceable()
        _, values, bb = QUANT_TYPES[self.qtype]
        if start % values or stop % values:
            raise ValueError(
                f"columns {start}:{stop} do not fall on {values}-value {self.qtype} block "
                "boundaries"
            )
        return QuantWeight(
            self.data[:, start // values * bb : stop // values * bb].contiguous(),
            self.qtype,
            stop - start,
        )

    @property
    def segments(self) -> list[QuantWeight]:
        return [self]

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
        """Stacked by rows: one weight where types agree, else a QuantStack."""
        if len({p.in_dim for p in parts}) != 1:
            raise ValueError(f"cannot stack weights of input sizes {[p.in_dim for p in parts]}")
        runs: list[list[QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].qtype == p.qtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        merged = [
            QuantWeight(torch.cat([p.data for p in run]).contiguous(), run[0].qtype, run[0].in_dim)
            for run in runs
        ]
        return merged[0] if len(merged) == 1 else QuantStack(merged)


@dataclass
class QuantStack:
    """Consecutive row ranges of one projection, each in its own quantized type."""

    segments: list[QuantWeight]

    MAX_SEGMENTS = 3  # kernels/cpu/decode_step.c's PsMatrix

    @property
    def out_dim(self) -> int:
        return sum(p.out_dim for p in self.segments)

    @property
    def in_dim(self) -> int:
        return self.segments[0].in_dim

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_dim, self.in_dim)

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.segments)

    @property
    def file_qtype(self) -> str:
        return "+".join(p.file_qtype for p in self.segments)


class QuantEmbedding:
    """Token embeddings as the file ships them: a lookup dequantizes only the rows it gathers."""

    def __init__(self, kernels, weight: QuantWeight) -> None:
        if weight.qtype not in QUANT_TYPES:
            raise ValueError(f"a {weight.qtype} embedding table cannot be looked up row by row")
        self.kernels, self.weight = kernels, weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.data.index_select(0, ids.reshape(-1).to(torch.int64))
        out = torch.empty(rows.shape[0], self.weight.in_dim)
        if rows.shape[0]:
            self.kernels.quant_dequant(
                rows, self.weight.type_id, rows.shape[0], self.weight.in_dim, out
            )
        return out.view(*ids.shape, self.weight.in_dim)


@dataclass
class ExpertBlocks:
    """A layer's experts on their GGUF blocks: each expert's gate and up stacked, and its down."""

    gate_up: list
    down: list

    @property
    def segments(self) -> list[QuantWeight]:
        return [p for w in self.gate_up + self.down for p in getattr(w, "segments", [w])]


@dataclass
class QuantLinear:
    """One projection's blocks, with a dense copy where prefill runs on one."""

    q: QuantWeight
    dense: torch.Tensor | None = None
