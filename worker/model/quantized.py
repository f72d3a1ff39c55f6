"""Quantized weights served as a GGUF file ships them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
without dequantizing: a `QuantWeight` is a matrix's raw blocks, one row of blocks per output feature, and
`QuantizedMatmul` is a matmul library (worker/model/linear.py's interface) over them."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from worker.model.linear import native_bf16

log = structlog.get_logger("worker.model.quantized")

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types --quantized-activations int8 multiplies in integers
# Q4_0 / Q4_1, Q8_0, Q4_K, Q5_K and Q6_K repacked at load for the integer kernel (kernels/cpu/packed_blocks.h:
# 16 rows interleaved, each block's 16 scales together; the K-quants keep their 256-value super-blocks and
# their size): the same values, read with 16-bit integer activations. Not GGUF types; their rows are
# interleaved, so a packed weight is never sliced.
# ggml's type id, values per block and bytes per block of each type the kernels serve (the K-quants pack
# 256 values a block: Q4_K and Q5_K with a 6-bit scale and min per 32, Q6_K with an int8 scale per 16).
# Q5_0 / Q5_1 are what a Q4_K_M / Q5_K_M file holds where a row is not a multiple of 256 values wide.
QUANT_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
               "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
               "F16": (1, 32, 64), "BF16": (30, 32, 64)}

PACKED_TYPES = {"Q4_x16": (100, 32, 20), "Q8_0_x16": (101, 32, 34), "Q4_K_x16": (102, 256, 152),
                "Q6_K_x16": (103, 256, 212), "Q5_K_x16": (104, 256, 184)}
PACKED_FROM = {"Q4_0": "Q4_x16", "Q4_1": "Q4_x16", "Q8_0": "Q8_0_x16", "Q4_K": "Q4_K_x16", "Q5_K": "Q5_K_x16",
               "Q6_K": "Q6_K_x16"}


@dataclass
class QuantWeight:
    """worker/weights/gguf_blocks.py reads them from a file; a rank of a tensor-parallel group takes its
    rows, or its columns in whole 32-value blocks."""
    data: torch.Tensor  # uint8 [out_dim, in_dim / 32 * block_bytes], contiguous
    qtype: str
    in_dim: int
    origin: str = ""  # a packed weight's type in the file
    gemm: torch.Tensor | None = None  # a BF16 weight in oneDNN's blocked layout (QuantizedMatmul.hold_gemm)

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
            raise ValueError(f"a {self.qtype} weight has its rows interleaved: slice the blocks before "
                             "packing")

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        self._sliceable()
        return QuantWeight(self.data[index].contiguous(), self.qtype, self.in_dim)

    def cols(self, start: int, stop: int) -> QuantWeight:
        """Columns [start, stop) — whole blocks only (a tensor-parallel split of the input dimension)."""
        self._sliceable()
        _, values, bb = QUANT_TYPES[self.qtype]
        if start % values or stop % values:
            raise ValueError(f"columns {start}:{stop} do not fall on {values}-value {self.qtype} block "
                             "boundaries")
        return QuantWeight(self.data[:, start // values * bb: stop // values * bb].contiguous(), self.qtype,
                           stop - start)

    @property
    def segments(self) -> list[QuantWeight]:
        return [self]

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
        """Rows of several weights stacked (q, k and v into one projection), same input size: one weight where
        they share a type, else a QuantStack of runs of one type each (a Q4_K_M file's Q4_K queries and keys
        beside its Q6_K values)."""
        if len({p.in_dim for p in parts}) != 1:
            raise ValueError(f"cannot stack weights of input sizes {[p.in_dim for p in parts]}")
        runs: list[list[QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].qtype == p.qtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        merged = [QuantWeight(torch.cat([p.data for p in run]).contiguous(), run[0].qtype, run[0].in_dim)
                  for run in runs]
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
    """The token embeddings as the file ships them (this rank's rows of blocks, unpacked): a lookup
    dequantizes just the rows it gathers, so the table is never held in fp32 (2.1 GB at Llama-3-8B's)."""

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
            self.kernels.quant_dequant(rows, self.weight.type_id, rows.shape[0], self.weight.in_dim, out)
        return out.view(*ids.shape, self.weight.in_dim)


@dataclass
class QuantLinear:
    """One projection as the quantized library holds it: the blocks, and the same weight in the dense
    library's layout where prefill runs on it (None: dequantized into a scratch matrix when needed)."""

    q: QuantWeight
    dense: torch.Tensor | None = None


class QuantizedMatmul:
    """Up to `max_kernel_rows` rows of activations go through the native weight-only kernel
    (kernels/cpu/quant_matmul.c: each block dequantized once into registers for several rows at a time, so
    a decode step reads 4.5-8.5 bits a weight instead of 32); more rows (prefill) dequantize the weight
    into a scratch fp32 matrix and run the dense matmul there. Where that switch pays is measured at start
    (`choose_threshold`).

    The matmul library for quantized weights (QuantWeight / QuantLinear); plain tensors (a matrix of a
    type the kernels do not serve) go to the dense library."""

    name = "quantized"

    def __init__(self, kernels, dense=None, max_kernel_rows: int = 16, int8_activations: bool = False,
                 packing: bool = False, pack_q8: bool | None = None) -> None:
        """int8_activations: the kernels round each row's 32-value blocks to int8 and multiply in integers
        (llama.cpp's scheme: faster, at 8-bit activations): with packing the packed layouts, one byte dot
        product a weight vector where 16-bit activations take two (what stays unpacked keeps fp32 ones, as
        the fused step multiplies it); without, the Q4_0 / Q4_1 / Q8_0 blocks as they lie. Otherwise fp32
        activations on the file's layout, exact up to summation order. packing: `pack` repacks Q4_0 / Q4_1 /
        K-quant weights for the integer kernel, which rounds activations to 16-bit integers per 32-value block
        (2^-16 of the block's largest value) unless int8_activations; Q8_0 only where the kernels multiply
        packed 8-bit weights in integers (AVX-512 VNNI; pack_q8 overrides it)."""
        from worker.model.linear import DenseMatmul

        self.kernels = kernels
        self.int8_activations = int8_activations
        self.packing = packing
        self.pack_q8 = getattr(kernels, "packed_q8_fast", True) if pack_q8 is None else pack_q8
        self.dense = dense or DenseMatmul()
        self.copies = None  # the library of the blocks' copies for prompt steps, where not `dense` (bf16)
        self.max_kernel_rows = max_kernel_rows
        self.bf16_gemm = native_bf16()
        self._scratch = torch.empty(0)

    def prepare(self, weight):
        return weight if isinstance(weight,
                                    (QuantWeight, QuantStack, QuantLinear)) else self.dense.prepare(weight)

    def pack(self, w: QuantWeight | QuantStack) -> QuantWeight | QuantStack:
        """w in the packed layout where packing is on and it applies (Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K
        runs of whole 16-row groups); anything else as it is. Same values: prefill's dense copy is made from
        either."""
        if not self.packing:
            return w
        if isinstance(w, QuantStack):
            return QuantStack([self.pack(p) for p in w.segments])
        if w.qtype not in PACKED_FROM or w.out_dim % 16:
            return w
        if w.qtype == "Q8_0" and not self.pack_q8:
            return w  # AVX2 multiplies packed 4-6 bit weights in integers, not packed 8-bit ones
        data, _ = self.kernels.pack(w.data, w.type_id, w.out_dim, w.in_dim)
        return QuantWeight(data, PACKED_FROM[w.qtype], w.in_dim, origin=w.qtype)

    def dequantize(self, w: QuantWeight | QuantStack, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(w.out_dim, w.in_dim) if out is None else out
        row = 0
        for p in w.segments:
            self.kernels.quant_dequant(p.data, p.type_id, p.out_dim, p.in_dim, out[row: row + p.out_dim])
            row += p.out_dim
        return out

    def kernel(self, x: torch.Tensor, w: QuantWeight | QuantStack) -> torch.Tensor:
        if isinstance(w, QuantStack):
            return torch.cat([self.kernel(x, p) for p in w.segments], dim=1)
        y = torch.empty(x.shape[0], w.out_dim)
        # int8 activations meet the packed layouts where packing is on (what the fused step multiplies in 8
        # bits, so both decode paths give the same floats), else the 32-value integer types as the file holds
        # them (llama.cpp's Q8 blocks); the rest take fp32 ones
        int8 = self.int8_activations and w.qtype in (PACKED_TYPES if self.packing else INT8_TYPES)
        self.kernels.quant_matmul(x, w.data, w.type_id, w.out_dim, y, int8)
        return y

    # x may come in bf16 and, with bf16_out, a product through the bf16 GEMM goes out in bf16 (the MLP's
    # gate/up for its SiLU·mul: the same values without a round trip through fp32 on either side)
    keeps_bf16 = True

    def __call__(self, x: torch.Tensor, w, bias: torch.Tensor | None = None,
                 bf16_out: bool = False) -> torch.Tensor:
        if not isinstance(w, (QuantWeight, QuantStack, QuantLinear)):  # the dense library's own weight
            return self.dense(x.float(), w, bias)
        q, dense = (w.q, w.dense) if isinstance(w, QuantLinear) else (w, None)
        if x.shape[0] > self.max_kernel_rows and (gemm := self._bf16_weight(q, dense)) is not None:
            xb = x if x.dtype == torch.bfloat16 else x.contiguous().to(torch.bfloat16)
            y = (F.linear(xb, gemm) if not gemm.is_mkldnn  # a BF16 file's one segment, as held
                 else torch.ops.mkldnn._linear_pointwise(xb, gemm, None, "none", [], ""))
            if bias is not None:
                return self.kernels.widen_bf16(y).add_(bias)
            return y if bf16_out else self.kernels.widen_bf16(y)
        x = x if x.is_contiguous() and x.dtype == torch.float32 else x.float().contiguous()
        if x.shape[0] <= self.max_kernel_rows:
            y = self.kernel(x, q)
            return y if bias is None else y.add_(bias)
        if dense is not None:
            return (self.copies or self.dense)(x, dense, bias)
        return self.tiled(x, q, bias)

    @staticmethod
    def gemm_copy_bytes(linears: list[QuantLinear]) -> int:
        """What hold_gemm would add: the BF16 weights' bytes once more."""
        return sum(w.q.nbytes for w in linears if isinstance(w.q, QuantWeight) and w.q.qtype == "BF16")

    def hold_gemm(self, linears: list[QuantLinear]) -> int:
        """Beside each BF16 weight's rows (the row kernels and the fused step read them), a copy in oneDNN's
        blocked layout for the bf16 GEMM: the same products (its sums are the plain GEMM's), without the
        reorder a plain weight costs every call (x1.6-1.9 at 16-64 rows). -> the weights given one."""
        if not (self.bf16_gemm and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return 0
        held = 0
        for w in linears:
            if isinstance(w.q, QuantWeight) and w.q.qtype == "BF16" and w.dense is None:
                w.q.gemm = torch.ops.mkldnn._reorder_linear_weight(w.q.data.view(torch.bfloat16))
                held += 1
        return held

    def _bf16_gemm_only(self, w) -> bool:
        return self.bf16_gemm and isinstance(w, QuantWeight) and w.qtype == "BF16"

    def bf16_rows(self, rows: int, w) -> bool:
        """Whether a step of `rows` rows multiplies w through the bf16 GEMM (its input may come in bf16, its
        output go out in bf16)."""
        if rows <= self.max_kernel_rows or not isinstance(w, (QuantWeight, QuantStack, QuantLinear)):
            return False
        return self._bf16_weight(*((w.q, w.dense) if isinstance(w, QuantLinear) else (w, None))) is not None

    def _bf16_weight(self, q, dense) -> torch.Tensor | None:
        """The bf16 weight a step of many rows multiplies through the bf16 GEMM: a BF16 file's rows (their
        blocked copy where held), or a quantized file's bf16 copy (`copies`: --quantized-prefill bf16)."""
        if dense is not None:
            return dense if self.copies is not None and dense.dtype == torch.bfloat16 else None
        if not self._bf16_gemm_only(q):
            return None
        return q.data.view(torch.bfloat16) if q.gemm is None else q.gemm

    SCRATCH_VALUES = 4 << 20  # 16 MB of fp32: the most of a weight dequantized at once for prefill

    def tiled(self, x: torch.Tensor, w: QuantWeight | QuantStack,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T on the dense library with no dense copy of w: a tile of rows (whole 16-row groups, within
        SCRATCH_VALUES) at a time dequantized into a small scratch matrix and multiplied there; bf16 weights
        where the CPU multiplies bf16 natively (AVX512_BF16, AMX) through the bf16 GEMM itself, the
        activations rounded to bf16 as that GEMM takes them."""
        y = torch.empty(x.shape[0], w.out_dim)
        step = max(16, self.SCRATCH_VALUES // w.in_dim // 16 * 16)
        if self._scratch.numel() < step * w.in_dim:
            self._scratch = torch.empty(step * w.in_dim)
        row = 0
        for p in w.segments:
            if p.qtype == "BF16" and self.bf16_gemm:  # the weights as they are, through oneDNN's bf16 GEMM
                y[:, row: row + p.out_dim] = F.linear(x.to(torch.bfloat16), p.data.view(torch.bfloat16))
                row += p.out_dim
                continue
            for a in range(0, p.out_dim, step):
                b = min(a + step, p.out_dim)
                tile = self._scratch[: (b - a) * p.in_dim].view(b - a, p.in_dim)
                self.kernels.quant_dequant(p.data[a:b], p.type_id, b - a, p.in_dim, tile)
                y[:, row + a: row + b] = x @ tile.t()
            row += p.out_dim
        return y if bias is None else y.add_(bias)


def every_linear(model) -> list[QuantLinear]:
    """Every quantized projection of every layer, and the LM head."""
    layers = [w for layer in model.layers for w in layer.w.values() if isinstance(w, QuantLinear)]
    return layers + ([model.head] if isinstance(model.head, QuantLinear) else [])


def model_linears(model) -> list[tuple[QuantLinear, int]]:
    """The quantized projections of a model's first layer, each counted once per layer, and its LM head once:
    what one forward multiplies, for choose_threshold."""
    layer = [w for w in model.layers[0].w.values() if isinstance(w, QuantLinear)]
    head = [model.head] if isinstance(model.head, QuantLinear) else []
    return [(w, len(model.layers)) for w in layer] + [(w, 1) for w in head]


def choose_threshold(lib: QuantizedMatmul, linears: list[tuple[QuantLinear, int]],
                     candidates=(1, 2, 4, 8, 16, 32, 64, 128, 256), reps: int = 3, rounds: int = 3) -> int:
    """The most rows for which the kernel beats the dense path (the dense library on its own layout, or
    dequantize + matmul where none is kept) over a forward's matmuls — each (linear, times a forward runs
    it) — timed on the model's own weights; sets it on lib (unbounded where the kernel wins at every count).
    A row count where the kernel loses is timed again,
    up to `rounds` times in all, each path keeping its best: one slow moment of a shared machine (another
    process starting beside the worker) must not send every decode step to the dense path for good."""
    from worker.model.linear import best_time

    def measure(rows: int, floor: float | None) -> tuple[float, float]:
        """(kernel, dense) seconds a forward; the dense path is not timed where the kernel beats `floor`,
        what the dense path took at the fewest rows (it takes no less at more): a forward of the dense path
        that dequantizes every weight costs seconds at 8B, each count."""
        kernel = dense = 0.0
        for w, uses in linears:
            x = torch.randn(rows, w.q.in_dim)
            kernel += uses * best_time(lambda w=w, x=x: lib.kernel(x, w.q), reps)
        if floor is not None and kernel <= floor:
            return kernel, floor
        for w, uses in linears:
            x = torch.randn(rows, w.q.in_dim)
            saved, lib.max_kernel_rows = lib.max_kernel_rows, 0
            try:
                dense += uses * best_time(lambda w=w, x=x: lib(x, w), reps)
            finally:
                lib.max_kernel_rows = saved
        return kernel, dense

    chosen, times, floor = 0, {}, None
    for rows in candidates:
        kernel, dense = measure(rows, floor)
        for _ in range(rounds - 1):
            if kernel <= dense:
                break
            again = measure(rows, floor)
            kernel, dense = min(kernel, again[0]), min(dense, again[1])
        floor = dense if floor is None else floor
        times[rows] = (round(kernel * 1e3, 3), round(dense * 1e3, 3))
        if kernel > dense:
            break
        chosen = rows
    # the kernel won at every count: it runs every step (the dense path's rate does not improve past them)
    else:
        chosen = 1 << 30
    lib.max_kernel_rows = max(chosen, 1)
    log.info("quantized_matmul_threshold", max_kernel_rows=lib.max_kernel_rows, ms_kernel_vs_dense=times)
    return lib.max_kernel_rows
