"""Quantized weights served as a GGUF file ships them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
without dequantizing.

`GGUFQuantSource` reads a GGUF's quantized matrices by their Hugging Face names, each as a `QuantWeight`
(the raw blocks, one row of blocks per output feature) — a rank of a tensor-parallel group takes its rows,
or its columns in whole 32-value blocks. llama.cpp stores the query and key projections of Llama-family
models with each head's rotary halves interleaved; their rows are put back in Hugging Face's order here
(a row permutation: every row's blocks stay as they are).

`QuantizedMatmul` is a matmul library (worker/linear.py's interface) over those weights: up to
`max_kernel_rows` rows of activations go through the native weight-only kernel (kernels/cpu/
quant_matmul.c: each block dequantized once into registers for up to four rows at a time, so a decode step
reads 4.5-8.5 bits a weight instead of 32); more rows (prefill) dequantize the weight into a scratch fp32
matrix and run the dense matmul there. Where that switch pays is measured at start (`choose_threshold`),
as the worker measures its other matmul choices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from worker.gguf_weights import QUANT_TYPES

log = structlog.get_logger("worker.quantized")

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types --quantized-activations int8 multiplies in integers
# Q4_0 / Q4_1, Q8_0, Q4_K, Q5_K and Q6_K repacked at load for the integer kernel (kernels/cpu/packed_blocks.h:
# 16 rows interleaved, each block's 16 scales together; the K-quants keep their 256-value super-blocks and
# their size): the same values, read with 16-bit integer activations. Not GGUF types; their rows are
# interleaved, so a packed weight is never sliced.
PACKED_TYPES = {"Q4_x16": (100, 32, 20), "Q8_0_x16": (101, 32, 34), "Q4_K_x16": (102, 256, 152),
                "Q6_K_x16": (103, 256, 212), "Q5_K_x16": (104, 256, 184)}
PACKED_FROM = {"Q4_0": "Q4_x16", "Q4_1": "Q4_x16", "Q8_0": "Q8_0_x16", "Q4_K": "Q4_K_x16", "Q5_K": "Q5_K_x16",
               "Q6_K": "Q6_K_x16"}


@dataclass
class QuantWeight:
    data: torch.Tensor  # uint8 [out_dim, in_dim / 32 * block_bytes], contiguous
    qtype: str
    in_dim: int
    origin: str = ""  # a packed weight's type in the file

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


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512_BF16 or AMX-BF16), where torch's bf16 GEMM
    (oneDNN) is faster than fp32's; elsewhere it is emulated, slower."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, c, lambda: False)()) for c in checks)


class CastSource:
    """A Hugging Face checkpoint's matrices as bf16 rows (`--dtype bfloat16` on a CPU): the projections, the
    head and the token table held at half fp32's bytes and read by the same kernels as a GGUF's blocks (the
    row kernels widen each value exactly; many rows go through the bf16 GEMM), everything else in fp32."""

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

    def get(self, hf_name: str, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> QuantWeight:
        t = self.checkpoint.get(self._name(hf_name), rows, cols).to(self.dtype).contiguous()
        if t.dim() != 2 or t.shape[1] % 32:
            raise ValueError(f"{hf_name}: {tuple(t.shape)} is not rows of whole 32-value blocks")
        return QuantWeight(t.view(torch.uint8), self.qtype_name, t.shape[1])

    def held_bytes(self, tied: bool) -> int:
        """The parameters at 2 bytes a value (the table twice where tied: looked up, and the head)."""
        from worker.memory_plan import parameter_count

        c = self.config
        return 2 * (parameter_count(c) + (c.vocab_size * c.hidden_size if tied else 0))


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file a model comes from: the model itself when it is one, or the file a folder prepared from
    one names in its pagedserve_model.json (the embedded default model's, found in its wheel); else None."""
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
        from worker.gguf_weights import find_embedded_gguf

        try:
            return find_embedded_gguf(name=info["source"])
        except FileNotFoundError:
            return None
    return None


class GGUFQuantSource:
    """A GGUF file's quantized matrices of a Llama-family model, by Hugging Face name. Where the file stacks
    matrices as one tensor (Phi-3's attn_qkv, and ffn_up holding gate then up), each is its rows of it."""

    LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}

    def __init__(self, path: str | Path, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        from worker.gguf_weights import PERMUTED_ARCHS, GGUFFile, rope_rows

        self.file = GGUFFile(path)
        self.path = self.file.path
        self.description = f"{self.path.name} on its own blocks"
        self.arch = self.file.arch
        self._tensors = self.file.tensors
        self._perm = {"attn_q": rope_rows(n_heads, head_dim), "attn_k": rope_rows(n_kv_heads, head_dim)}
        self._permute = self.arch in PERMUTED_ARCHS
        self._q_rows, self._kv_rows = n_heads * head_dim, n_kv_heads * head_dim

    def held_bytes(self, tied: bool) -> int:
        """What serving this file holds in memory: the blocks of the types the kernels serve (packed ones up
        to 6% larger), every other tensor in fp32, and a tied table's blocks twice (looked up, and packed
        for the head)."""
        held = 0
        for t in self._tensors.values():
            quantized = t.tensor_type.name in QUANT_TYPES
            held += int(t.n_bytes) * 106 // 100 if quantized else 4 * int(t.n_elements)
        embd = self._tensors.get("token_embd.weight")
        if (tied and embd is not None and "output.weight" not in self._tensors
                and embd.tensor_type.name in QUANT_TYPES):
            held += int(embd.n_bytes)
        return held

    def _locate(self, hf_name: str) -> tuple[str, int, int | None]:
        """-> (the file's tensor holding the matrix, its first row there, its rows there or None: all)."""
        name = self.gguf_name(hf_name)
        prefix, kind = name.rsplit(".", 2)[0], name.split(".")[-2]
        qkv = f"{prefix}.attn_qkv.weight"
        if kind in ("attn_q", "attn_k", "attn_v") and name not in self._tensors and qkv in self._tensors:
            q, kv = self._q_rows, self._kv_rows
            return qkv, {"attn_q": 0, "attn_k": q, "attn_v": q + kv}[kind], q if kind == "attn_q" else kv
        up = f"{prefix}.ffn_up.weight"
        if kind in ("ffn_gate",
                    "ffn_up") and f"{prefix}.ffn_gate.weight" not in self._tensors and up in self._tensors:
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
            key = ".".join(parts[3:5])
            if key in self.LAYER:
                return f"blk.{parts[2]}.{self.LAYER[key]}.weight"
        raise KeyError(f"{hf_name} has no quantized matrix in {self.path.name}")

    def qtype(self, hf_name: str) -> str | None:
        """The quantization of a matrix, or None when the kernels do not serve its type (F32, Q3_K, ...)."""
        name = self._locate(hf_name)[0]
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{hf_name} ({name}) is missing from {self.path.name}")
        return t.tensor_type.name if t.tensor_type.name in QUANT_TYPES else None

    def get(self, hf_name: str, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> QuantWeight:
        name, first, count = self._locate(hf_name)
        t = self._tensors[name]
        qtype = t.tensor_type.name
        if qtype not in QUANT_TYPES:
            raise ValueError(f"{name} is {qtype}; the quantized kernels serve {', '.join(QUANT_TYPES)}")
        in_dim = int(t.shape[0])  # ggml lists dimensions innermost first
        w = QuantWeight(self.file.read(name), qtype, in_dim)  # read into this process's memory, not mapped
        kind = name.split(".")[-2]
        if self._permute and kind in self._perm:
            w = w.rows(self._perm[kind])
        if count is not None:  # this matrix's rows of a stacked tensor
            rows = (first + (rows or (0, count))[0], first + (rows or (0, count))[1])
        if rows is not None:
            w = w.rows(slice(*rows))
        if cols is not None:
            w = w.cols(*cols)
        return w


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
    """The matmul library for quantized weights (QuantWeight / QuantLinear); plain tensors (a matrix of a
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
        from worker.linear import DenseMatmul

        self.kernels = kernels
        self.int8_activations = int8_activations
        self.packing = packing
        self.pack_q8 = getattr(kernels, "packed_q8_fast", True) if pack_q8 is None else pack_q8
        self.dense = dense or DenseMatmul()
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
        if x.shape[0] > self.max_kernel_rows and dense is None and bias is None and self._bf16_gemm_only(q):
            xb = x if x.dtype == torch.bfloat16 else x.contiguous().to(torch.bfloat16)
            y = F.linear(xb, q.data.view(torch.bfloat16))  # one segment: the weights as they are
            return y if bf16_out else y.float()
        x = x if x.is_contiguous() and x.dtype == torch.float32 else x.float().contiguous()
        if x.shape[0] <= self.max_kernel_rows:
            y = self.kernel(x, q)
            return y if bias is None else y.add_(bias)
        if dense is not None:
            return self.dense(x, dense, bias)
        return self.tiled(x, q, bias)

    def _bf16_gemm_only(self, w) -> bool:
        return self.bf16_gemm and isinstance(w, QuantWeight) and w.qtype == "BF16"

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
    from worker.linear import best_time

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
