"""GGUF quantized weights served as shipped, never dequantized for decode: `QuantizedMatmul`
multiplies by a matrix's blocks (model/quant_weights.py) behind model/linear.py's interface.
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F

from worker.model.linear import native_bf16
from worker.model.quant_weights import (
    PACKED_FROM,
    PACKED_TYPES,
    QuantLinear,
    QuantStack,
    QuantWeight,
)

log = structlog.get_logger("worker.model.quantized")

# the types --quantized-activations int8 multiplies in integers
INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")


class QuantizedMatmul:
    """Few rows through the native kernel on the blocks; more dequantize tiles and run dense."""

    name = "quantized"

    def __init__(
        self,
        kernels,
        dense=None,
        max_kernel_rows: int = 16,
        int8_activations: bool = False,
        packing: bool = False,
        pack_q8: bool | None = None,
    ) -> None:
        """int8_activations: llama.cpp's int8 products; else fp32, exact to summation order."""
        from worker.model.linear import DenseMatmul

        self.kernels = kernels
        self.int8_activations = int8_activations
        self.packing = packing
        self.pack_q8 = pack_q8  # None: where Q8_0's packed integer kernel is fast (q8_packs)
        self.dense = dense or DenseMatmul()
        # the library of the blocks' copies for prompt steps, where not `dense` (bf16)
        self.copies = None
        self.max_kernel_rows = max_kernel_rows
        self.bf16_gemm = native_bf16()
        self._scratch = torch.empty(0)

    def prepare(self, weight):
        return (
            weight
            if isinstance(weight, (QuantWeight, QuantStack, QuantLinear))
            else self.dense.prepare(weight)
        )

    def pack(self, w: QuantWeight | QuantStack, tail: bool = False) -> QuantWeight | QuantStack:
        """w repacked where packing applies, else as it is. tail: rows past the last whole 16 (a
        vocabulary of 100,278: OLMo's head) kept apart as they are, the rest packed; else such a
        matrix stays unpacked whole (experts: their kernel reads one type).
        """
        if not self.packing:
            return w
        if isinstance(w, QuantStack):
            segments = [s for p in w.segments for s in self.pack(p, tail).segments]
            return QuantStack(segments) if len(segments) > 1 else segments[0]
        whole = w.out_dim // 16 * 16
        if tail and w.qtype in PACKED_FROM and 0 < whole < w.out_dim:
            # the tail a copy, not a view: the file's whole matrix is let go
            rest = QuantWeight(w.data[whole:].clone(), w.qtype, w.in_dim)
            return QuantStack([*self.pack(w.rows(slice(0, whole))).segments, rest])
        if w.qtype not in PACKED_FROM or w.out_dim % 16:
            return w
        if w.qtype == "Q8_0" and not self.q8_packs():
            return w  # AVX2's packed 8-bit weights meet 8-bit activations only
        try:
            data, _ = self.kernels.pack(w.data, w.type_id, w.out_dim, w.in_dim)
        except ValueError:
            if w.qtype not in ("MXFP4", "Q5_0"):
                raise
            return w  # a scale (or Q5_0's -16 d) past fp16's range: as the file ships it
        return QuantWeight(data, PACKED_FROM[w.qtype], w.in_dim, origin=w.qtype)

    def q8_packs(self) -> bool:
        """Whether Q8_0 packs: as told, else where its kernel is fast for these activations."""
        if self.pack_q8 is not None:
            return self.pack_q8
        fast = "packed_q8_x8_fast" if self.int8_activations else "packed_q8_fast"
        return getattr(self.kernels, fast, True)

    def dequantize(
        self, w: QuantWeight | QuantStack, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = torch.empty(w.out_dim, w.in_dim) if out is None else out
        row = 0
        for p in w.segments:
            self.kernels.quant_dequant(
                p.data, p.type_id, p.out_dim, p.in_dim, out[row : row + p.out_dim]
            )
            row += p.out_dim
        return out

    def kernel(self, x: torch.Tensor, w: QuantWeight | QuantStack) -> torch.Tensor:
        if isinstance(w, QuantStack):
            return torch.cat([self.kernel(x, p) for p in w.segments], dim=1)
        y = torch.empty(x.shape[0], w.out_dim)
        # int8 activations on packed layouts (as the fused step, so both decode paths agree), or the
        # file's 32-value types; the rest fp32
        int8 = self.int8_activations and w.qtype in (PACKED_TYPES if self.packing else INT8_TYPES)
        self.kernels.quant_matmul(x, w.data, w.type_id, w.out_dim, y, int8)
        return y

    # bf16 in, and with bf16_out bf16 out: no fp32 round trip around the MLP's gate/up
    keeps_bf16 = True

    def __call__(
        self, x: torch.Tensor, w, bias: torch.Tensor | None = None, bf16_out: bool = False
    ) -> torch.Tensor:
        # the dense library's own weight
        if not isinstance(w, (QuantWeight, QuantStack, QuantLinear)):
            return self.dense(x.float(), w, bias)
        q, dense = (w.q, w.dense) if isinstance(w, QuantLinear) else (w, None)
        if x.shape[0] > self.max_kernel_rows and (gemm := self._bf16_weight(q, dense)) is not None:
            xb = x if x.dtype == torch.bfloat16 else x.contiguous().to(torch.bfloat16)
            y = (
                F.linear(xb, gemm)
                if not gemm.is_mkldnn  # a BF16 file's one segment, as held
                else torch.ops.mkldnn._linear_pointwise(xb, gemm, None, "none", [], "")
            )
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
        return sum(
            w.q.nbytes for w in linears if isinstance(w.q, QuantWeight) and w.q.qtype == "BF16"
        )

    def hold_gemm(self, linears: list[QuantLinear]) -> int:
        """A oneDNN blocked copy beside each BF16 weight (x1.6-1.9 at 16-64 rows)."""
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
        """Whether `rows` rows multiply w through the bf16 GEMM."""
        if rows <= self.max_kernel_rows or not isinstance(
            w, (QuantWeight, QuantStack, QuantLinear)
        ):
            return False
        return (
            self._bf16_weight(*((w.q, w.dense) if isinstance(w, QuantLinear) else (w, None)))
            is not None
        )

    def _bf16_weight(self, q, dense) -> torch.Tensor | None:
        """The bf16 weight a wide step multiplies."""
        if dense is not None:
            return dense if self.copies is not None and dense.dtype == torch.bfloat16 else None
        if not self._bf16_gemm_only(q):
            return None
        return q.data.view(torch.bfloat16) if q.gemm is None else q.gemm

    SCRATCH_VALUES = 4 << 20  # 16 MB of fp32: the most of a weight dequantized at once for prefill

    def tiled(
        self, x: torch.Tensor, w: QuantWeight | QuantStack, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ w.T with no dense copy: tiles dequantized into scratch."""
        y = torch.empty(x.shape[0], w.out_dim)
        step = max(16, self.SCRATCH_VALUES // w.in_dim // 16 * 16)
        if self._scratch.numel() < step * w.in_dim:
            self._scratch = torch.empty(step * w.in_dim)
        row = 0
        for p in w.segments:
            # the weights as they are, through oneDNN's bf16 GEMM
            if p.qtype == "BF16" and self.bf16_gemm:
                y[:, row : row + p.out_dim] = F.linear(
                    x.to(torch.bfloat16), p.data.view(torch.bfloat16)
                )
                row += p.out_dim
                continue
            for a in range(0, p.out_dim, step):
                b = min(a + step, p.out_dim)
                tile = self._scratch[: (b - a) * p.in_dim].view(b - a, p.in_dim)
                self.kernels.quant_dequant(p.data[a:b], p.type_id, b - a, p.in_dim, tile)
                y[:, row + a : row + b] = x @ tile.t()
            row += p.out_dim
        return y if bias is None else y.add_(bias)


def every_linear(model) -> list[QuantLinear]:
    """Every quantized projection of every layer, and the LM head."""
    layers = [w for layer in model.layers for w in layer.w.values() if isinstance(w, QuantLinear)]
    return layers + ([model.head] if isinstance(model.head, QuantLinear) else [])


def model_linears(model) -> list[tuple[QuantLinear, int]]:
    """What one forward multiplies: the first layer's projections once per layer, and the head."""
    layer = [w for w in model.layers[0].w.values() if isinstance(w, QuantLinear)]
    head = [model.head] if isinstance(model.head, QuantLinear) else []
    return [(w, len(model.layers)) for w in layer] + [(w, 1) for w in head]


def choose_threshold(
    lib: QuantizedMatmul,
    linears: list[tuple[QuantLinear, int]],
    candidates=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    reps: int = 3,
    rounds: int = 3,
) -> int:
    """Set the most rows for which the kernel beats dense on these weights; losses are retimed."""
    from worker.model.linear import best_time

    def measure(rows: int, floor: float | None) -> tuple[float, float]:
        """(kernel, dense) seconds a forward; dense is skipped where the kernel beats its
        fewest-rows time.
        """
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
    # the kernel won at every count
    else:
        chosen = 1 << 30
    lib.max_kernel_rows = max(chosen, 1)
    log.info(
        "quantized_matmul_threshold", max_kernel_rows=lib.max_kernel_rows, ms_kernel_vs_dense=times
    )
    return lib.max_kernel_rows
