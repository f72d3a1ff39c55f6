"""Native CPU kernels (kernels/cpu/*.c), built on first use and called through ctypes (which
releases the GIL); OpenMP shares torch's libgomp pool. Without a compiler `load()` returns None and
callers keep torch.
"""

from __future__ import annotations

import ctypes
import platform
import re
import subprocess
from pathlib import Path

import structlog
import torch

from kernels.cpu_attention import NativeAttention
from kernels.cpu_build import SOURCE_DIR, build
from kernels.cpu_recurrent import NativeRecurrent
from protos.base import env

log = structlog.get_logger("kernels.cpu_native")

HEADER = SOURCE_DIR / "pagedserve.h"
_C_TYPES = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


# the fused decode step's stages as pagedserve_decode_profile counts them (kernels/cpu/pagedserve.h)
_STAGES = "norms rounding qkv heads attention o_proj gate_up silu down lora mamba experts"
DECODE_STAGES = tuple(_STAGES.split())


def prototypes(header: str) -> dict[str, tuple[object, list]]:
    """(restype, argtypes) of each `pagedserve_*` function the header declares."""

    def ctype(decl: str):
        decl = decl.strip()
        if "*" in decl:
            return ctypes.c_void_p
        words = decl.replace("const ", "").split()
        return _C_TYPES[words[0]]

    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    found = {}
    for ret, name, params in re.findall(
        r"^\s*([\w ]+?\**)\s*(pagedserve_\w+)\s*\(([^)]*)\);", text, re.M
    ):
        args = [] if params.strip() in ("", "void") else [ctype(p) for p in params.split(",")]
        found[name] = (ctype(ret), args)
    return found


def blas_sgemm() -> int | None:
    """torch's BLAS `sgemm_` address for the fused step; None if absent."""
    suffix = ".dylib" if platform.system() == "Darwin" else ".so"
    lib = Path(torch.__file__).parent / "lib" / ("libtorch_cpu" + suffix)
    try:
        return ctypes.cast(ctypes.CDLL(str(lib)).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class NativeKernels(NativeAttention, NativeRecurrent):
    """The loaded library: fused decode, quantized matmuls, elementwise ops, paged attention."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        for name, (restype, argtypes) in prototypes(HEADER.read_text()).items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._bind_attention(lib)
        self._bind_recurrent(lib)
        self._add_rms_norm, self._silu_mul = lib.pagedserve_add_rms_norm, lib.pagedserve_silu_mul
        self._silu_mul_bf16, self._widen_bf16 = (
            lib.pagedserve_silu_mul_bf16,
            lib.pagedserve_widen_bf16,
        )
        self._add_rms_norm_mixed = lib.pagedserve_add_rms_norm_mixed
        self._argmax_rows = lib.pagedserve_argmax_rows
        self._quant_matmul = lib.pagedserve_quant_matmul
        self._quant_matmul_q8act = lib.pagedserve_quant_matmul_q8act
        self._moe_experts = lib.pagedserve_moe_experts
        self._quant_dequant, self._pack = lib.pagedserve_quant_dequant, lib.pagedserve_pack
        self._decode_step = lib.pagedserve_decode_step
        self._decode_step_scratch = lib.pagedserve_decode_step_scratch
        self._decode_profile = lib.pagedserve_decode_profile
        # the packed kernel's integer dots need VNNI (or AVX2 for 4-6 bits); elsewhere nothing is
        # packed
        self.packed_fast = bool(lib.pagedserve_packed_fast())
        # Q8_0 packs with VNNI, and on AVX2 for 8-bit activations only
        q8 = lib.pagedserve_packed_q8_fast
        self.packed_q8_fast, self.packed_q8_x8_fast = q8(0) == 1, q8(1) == 1
        # 512: AVX-512 intrinsics; 256: AVX2 (the portable loops)
        self.isa = lib.pagedserve_native_isa()
        # BF16 rows at bf16 activations, bf16_rounded(1 | 0 | -1: asks): 2 AMX tiles, 1 AVX512_BF16
        self.bf16_rounded = lib.pagedserve_bf16_rounded
        self.amx_bf16, self.bf16_dots = self.bf16_rounded(-1) == 2, self.bf16_rounded(-1) == 1
        sizes = (ctypes.c_int64 * 7)()
        lib.pagedserve_struct_sizes(sizes)
        # PsSegment, PsMatrix, PsLayer, PsModel, PsLoraProj, PsLora, PsExperts (kernels/cpu_step.py)
        self.struct_sizes = tuple(sizes)
        self.sgemm = blas_sgemm()

    # --- the fused decode step (worker/model/fused_decode.py describes the model) -----------------
    def decode_step_scratch(self, model_desc, rows: int) -> int:
        """Floats of scratch a fused decode step of `rows` tokens needs."""
        return self._decode_step_scratch(ctypes.addressof(model_desc), rows)

    def decode_step(
        self,
        model_desc,
        rows: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scratch: torch.Tensor,
        lora=None,
        state_slots: torch.Tensor | None = None,
    ) -> None:
        """Every layer for `rows` decoding tokens in one call: x fp32 [rows, hidden] -> final-
        normed; state_slots: int64 [rows], each row's slot in the state pool (Mamba2 layers).
        """
        states = slots if state_slots is None else state_slots  # checked alike, passed if given
        for t, dt in (
            (x, torch.float32),
            (positions, torch.int64),
            (slots, torch.int64),
            (states, torch.int64),
            (block_tables, torch.int32),
            (seq_lens, torch.int32),
            (scratch, torch.float32),
        ):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(
                    f"decode_step needs {dt} tensors on the CPU, got {t.dtype} on {t.device}"
                )
        if not (
            x.is_contiguous()
            and all(t.is_contiguous() for t in (positions, slots, states, seq_lens))
            and block_tables.stride(1) == 1
            and x.shape[0] == rows
            and positions.numel()
            == slots.numel()
            == states.numel()
            == seq_lens.numel()
            == block_tables.shape[0]
            == rows
            and scratch.numel() >= self.decode_step_scratch(model_desc, rows)
        ):
            raise ValueError(
                "decode_step needs contiguous tensors of `rows` tokens and enough scratch"
            )
        if self._decode_step(
            ctypes.addressof(model_desc),
            rows,
            x.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            None if lora is None else ctypes.addressof(lora),
            None if state_slots is None else state_slots.data_ptr(),
            scratch.data_ptr(),
        ):
            raise ValueError("decode_step does not serve this model's shapes")

    def decode_profile(self, on: bool) -> dict[str, float]:
        """Per-stage wall time of the fused step since the last call, and the steps it covers."""
        out = (ctypes.c_int64 * (len(DECODE_STAGES) + 1))()
        if self._decode_profile(int(on), out) != len(DECODE_STAGES):
            raise RuntimeError("the library's decode stages differ from DECODE_STAGES")
        n = len(DECODE_STAGES)
        return {name: out[i] / 1e9 for i, name in enumerate(DECODE_STAGES)} | {"steps": out[n]}

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens: the first largest index, NaN never, -1 if all -inf."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
            raise TypeError(
                f"argmax_rows needs fp32 [rows, vocab] logits on the CPU, got {logits.dtype} "
                f"{tuple(logits.shape)} on {logits.device}"
            )
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out

    # --- weight-only quantized matmuls on GGUF blocks (worker/model/quantized.py) -----------------
    def quant_matmul(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        type_id: int,
        out_dim: int,
        y: torch.Tensor,
        int8_activations: bool = False,
    ) -> None:
        """y = x @ W.T over ggml blocks; int8_activations as llama.cpp does (VNNI where present)."""
        rows, in_dim = x.shape
        if not (
            x.dtype == y.dtype == torch.float32
            and w.dtype == torch.uint8
            and x.is_contiguous()
            and y.is_contiguous()
            and w.is_contiguous()
            and tuple(y.shape) == (rows, out_dim)
        ):
            raise ValueError("quant_matmul needs contiguous fp32 x and y and uint8 blocks")
        fn = self._quant_matmul_q8act if int8_activations else self._quant_matmul
        rc = fn(x.data_ptr(), rows, in_dim, w.data_ptr(), out_dim, type_id, y.data_ptr())
        if rc == -2:
            raise MemoryError("quant_matmul could not allocate the quantized activations")
        if rc:
            raise ValueError(
                f"quant_matmul does not serve ggml type {type_id} with {in_dim} inputs"
            )

    def moe_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, torch.Tensor | None],
        inter: int,
        act: tuple[float, float, bool],
        bits8: bool,
        out: torch.Tensor,
    ) -> None:
        """out = each row's chosen experts' weighted sum. experts: block addresses (gate_up, down)
        and their two types; act: the clamped SwiGLU's (limit, alpha), limit 0: SiLU-mul, and
        whether the experts are up alone, relu² (Nemotron-H's)."""
        gate_up, down, types = experts
        tokens, hidden = x.shape
        kinds = (x.dtype, ids.dtype, weights.dtype) == (torch.float32, torch.int64, torch.float32)
        if not (
            kinds and ids.shape == weights.shape and len(ids) == tokens and out.shape == x.shape
        ):
            raise ValueError("moe_experts needs fp32 x, int64 ids and fp32 weights [tokens, k]")
        rc = self._moe_experts(
            x.data_ptr(),
            tokens,
            ids.shape[1],
            ids.data_ptr(),
            weights.data_ptr(),
            gate_up.data_ptr(),
            down.data_ptr(),
            types.data_ptr(),
            *(None if b is None else b.data_ptr() for b in biases),
            gate_up.numel(),
            hidden,
            inter,
            *act[:2],
            int(act[2]),
            int(bits8),
            out.data_ptr(),
        )
        if rc:
            raise (MemoryError if rc == -2 else ValueError)(f"moe_experts failed ({rc})")

    def quant_dequant(
        self, w: torch.Tensor, type_id: int, out_dim: int, in_dim: int, out: torch.Tensor
    ) -> None:
        """out (fp32 [out_dim, in_dim], contiguous) = the blocks of w dequantized."""
        if not (
            out.dtype == torch.float32
            and out.is_contiguous()
            and w.is_contiguous()
            and out.numel() == out_dim * in_dim
        ):
            raise ValueError("quant_dequant needs a contiguous fp32 output of out_dim x in_dim")
        if self._quant_dequant(w.data_ptr(), out_dim, in_dim, type_id, out.data_ptr()):
            raise ValueError(
                f"quant_dequant does not serve ggml type {type_id} with {in_dim} inputs"
            )

    # packed_blocks.h's type ids: 16 rows interleaved, multiplied with 16-bit integer activations
    PACKED_Q4, PACKED_Q8, PACKED_Q4K, PACKED_Q6K, PACKED_Q5K, PACKED_MX4 = range(100, 106)
    PACKED_Q5 = 106
    # ggml type -> (packed type, bytes a row per block, values a block): Q4_0, Q4_1, Q5_0, Q5_1,
    # Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
    _PACKABLE = {
        2: (PACKED_Q4, 20, 32),
        3: (PACKED_Q4, 20, 32),
        6: (PACKED_Q5, 24, 32),
        7: (PACKED_Q5, 24, 32),
        8: (PACKED_Q8, 34, 32),
        12: (PACKED_Q4K, 152, 256),
        13: (PACKED_Q5K, 184, 256),
        14: (PACKED_Q6K, 212, 256),
        39: (PACKED_MX4, 17, 32),
    }

    def pack(
        self, w: torch.Tensor, type_id: int, out_dim: int, in_dim: int
    ) -> tuple[torch.Tensor, int]:
        """Blocks -> (interleaved packed rows, type id) for quant_matmul; the result cannot be
        sliced.
        """
        if not (w.dtype == torch.uint8 and w.is_contiguous() and w.device.type == "cpu"):
            raise ValueError("pack needs contiguous uint8 blocks on the CPU")
        packed, bb, values = self._PACKABLE.get(type_id, (0, 0, 32))
        out = torch.empty(out_dim, in_dim // values * bb, dtype=torch.uint8)
        if not packed or self._pack(w.data_ptr(), out_dim, in_dim, type_id, out.data_ptr()):
            raise ValueError(
                "pack packs Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 (scales 2^-24..2^12) "
                f"matrices of whole 16-row groups, not type {type_id} {out_dim}x{in_dim}"
            )
        return out, packed

    # --- the elementwise tail (fp32, contiguous rows; worker/model/elementwise.py checks) --------
    def add_rms_norm(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        """residual += delta (when given, in place), out = rms_norm(residual) * weight."""
        rows, dim = residual.shape
        self._add_rms_norm(
            residual.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            float(eps),
        )

    def add_rms_norm_mixed(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        """residual += delta; out = rms_norm(residual) * weight, fp32 or bf16 each."""
        rows, dim = residual.shape
        bf16 = torch.bfloat16
        self._add_rms_norm_mixed(
            residual.data_ptr(),
            None if delta is None else delta.data_ptr(),
            int(delta is not None and delta.dtype == bf16),
            weight.data_ptr(),
            out.data_ptr(),
            int(out.dtype == bf16),
            rows,
            dim,
            float(eps),
        )

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate) * up, fp32 or bf16 (computed in fp32, rounded to nearest even)."""
        rows, width = gate_up.shape
        fn = self._silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else self._silu_mul
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)

    def widen_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (bf16, contiguous) as a new fp32 tensor of its shape: exact."""
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.device.type == "cpu"):
            raise ValueError("widen_bf16 needs a contiguous bf16 tensor on the CPU")
        out = torch.empty(x.shape, dtype=torch.float32)
        self._widen_bf16(x.data_ptr(), out.data_ptr(), x.numel())
        return out


_LOADED: NativeKernels | None = None
_TRIED = False


def load() -> NativeKernels | None:
    """The native kernels, built if needed; None (logged once) if not, or PAGEDSERVE_NATIVE=0."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    if not env.native_kernels():
        return None
    try:
        path = build()
        _LOADED = NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native_kernels_unavailable", error=str(e))
        _LOADED = None
    return _LOADED


if __name__ == "__main__":  # `make setup` builds the library ahead of the first start
    build(verbose=True)
