"""Native CPU kernels (kernels/cpu/*.c: paged decode and prefill attention, the fused elementwise tail, the
quantized matmuls, the fused decode step), built for this machine on first use (kernels/cpu_build.py) and
called through ctypes. Its OpenMP symbols bind to the libgomp torch has already loaded, so the kernels and
torch share one thread pool. ctypes releases the GIL for the call. Where no compiler is found, or the build
fails, `load()` returns None and callers keep their pure-torch path.
"""

from __future__ import annotations

import ctypes
import platform
import re
import subprocess
from pathlib import Path

import structlog
import torch

from kernels.cpu_build import SOURCE_DIR, build
from protos.base import env

log = structlog.get_logger("kernels.cpu_native")

HEADER = SOURCE_DIR / "pagedserve.h"
_C_TYPES = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float}


# the fused decode step's stages as pagedserve_decode_profile counts them (kernels/cpu/pagedserve.h)
DECODE_STAGES = ("norms", "rounding", "qkv", "heads", "attention", "o_proj", "gate_up", "silu", "down",
                 "lora")


def prototypes(header: str) -> dict[str, tuple[object, list]]:
    """Each `pagedserve_*` function the header declares: (ctypes restype, argtypes). Pointers of any kind
    pass as void pointers (torch data pointers), scalars as their fixed-width types."""

    def ctype(decl: str):
        decl = decl.strip()
        if "*" in decl:
            return ctypes.c_void_p
        words = decl.replace("const ", "").split()
        return _C_TYPES[words[0]]

    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    found = {}
    for ret, name, params in re.findall(r"^\s*([\w ]+?\**)\s*(pagedserve_\w+)\s*\(([^)]*)\);", text, re.M):
        args = [] if params.strip() in ("", "void") else [ctype(p) for p in params.split(",")]
        found[name] = (ctype(ret), args)
    return found


def blas_sgemm() -> int | None:
    """The address of the BLAS `sgemm_` (Fortran interface, 32-bit integers) that torch's CPU library carries
    (MKL on x86 builds), for the fused decode step's larger matmuls; None where it exports none."""
    lib = Path(torch.__file__).parent / "lib" / ("libtorch_cpu" + (".dylib" if platform.system() == "Darwin"
                                                                    else ".so"))
    try:
        return ctypes.cast(ctypes.CDLL(str(lib)).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class NativeKernels:
    """The loaded library: `paged_decode(...)` and its compile-time limits."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        for name, (restype, argtypes) in prototypes(HEADER.read_text()).items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._decode, self._prefill = lib.pagedserve_paged_decode, lib.pagedserve_paged_prefill
        self._add_rms_norm, self._silu_mul = lib.pagedserve_add_rms_norm, lib.pagedserve_silu_mul
        self._silu_mul_bf16, self._rope = lib.pagedserve_silu_mul_bf16, lib.pagedserve_rope
        self._widen_bf16, self._write_kv = lib.pagedserve_widen_bf16, lib.pagedserve_write_kv
        self._add_rms_norm_mixed = lib.pagedserve_add_rms_norm_mixed
        self._head_rms_norm, self._argmax_rows = lib.pagedserve_head_rms_norm, lib.pagedserve_argmax_rows
        self._quant_matmul = lib.pagedserve_quant_matmul
        self._quant_matmul_q8act = lib.pagedserve_quant_matmul_q8act
        self._quant_dequant, self._pack = lib.pagedserve_quant_dequant, lib.pagedserve_pack
        self._decode_step = lib.pagedserve_decode_step
        self._decode_step_scratch = lib.pagedserve_decode_step_scratch
        self._decode_profile = lib.pagedserve_decode_profile
        limits = (ctypes.c_int32 * 3)()
        lib.pagedserve_decode_limits(limits)
        self.max_group, self.max_head_dim, self.max_block = limits[0], limits[1], limits[2]
        lib.pagedserve_prefill_limits(limits)
        self.prefill_state, self.prefill_max_head_dim = limits[0], limits[1]
        # a bf16 pool's prefill can run in bf16 dot products here (AVX512_BF16; see paged_prefill.c)
        self.prefill_bf16_dots = bool(lib.pagedserve_prefill_bf16_dots())
        self._prefill_tiles = lib.pagedserve_prefill_tiles
        # the packed kernel has its integer dot products here (AVX-512 VNNI, or AVX2 for the 4-6 bit layouts);
        # elsewhere its portable loop is slower than the fp32-activation kernel, and the worker packs nothing
        self.packed_fast = bool(lib.pagedserve_packed_fast())
        self.packed_q8_fast = bool(lib.pagedserve_packed_q8_fast())  # AVX2 packs the 4-6 bit types only
        self.isa = lib.pagedserve_native_isa()  # 512: AVX-512 intrinsics; 256: AVX2 (the portable loops)
        sizes = (ctypes.c_int64 * 6)()
        lib.pagedserve_struct_sizes(sizes)
        # PsSegment, PsMatrix, PsLayer, PsModel, PsLoraProj, PsLora (model/fused_decode.py)
        self.struct_sizes = tuple(sizes)
        self.sgemm = blas_sgemm()

    # --- the fused decode step (worker/model/fused_decode.py describes the model) --------------------
    def decode_step_scratch(self, model_desc, rows: int) -> int:
        """Floats of scratch a fused decode step of `rows` tokens needs."""
        return self._decode_step_scratch(ctypes.addressof(model_desc), rows)

    def decode_step(self, model_desc, rows: int, x: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scratch: torch.Tensor,
                    lora=None) -> None:
        """Every layer of `rows` decoding tokens in one call: x fp32 [rows, hidden] contiguous holds their
        embeddings and receives the final-norm hidden states; positions, slots int64 [rows]; block_tables
        int32 [rows, max_blocks] (row stride may exceed max_blocks); seq_lens int32 [rows]; lora: a PsLora
        (model/fused_decode.py) naming the rows' adapters, or None."""
        for t, dt in ((x, torch.float32), (positions, torch.int64), (slots, torch.int64),
                      (block_tables, torch.int32), (seq_lens, torch.int32), (scratch, torch.float32)):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(f"decode_step needs {dt} tensors on the CPU, got {t.dtype} on {t.device}")
        if not (x.is_contiguous() and positions.is_contiguous() and slots.is_contiguous()
                and seq_lens.is_contiguous() and block_tables.stride(1) == 1 and x.shape[0] == rows
                and positions.numel() == slots.numel() == seq_lens.numel() == block_tables.shape[0] == rows
                and scratch.numel() >= self.decode_step_scratch(model_desc, rows)):
            raise ValueError("decode_step needs contiguous tensors of `rows` tokens and enough scratch")
        if self._decode_step(ctypes.addressof(model_desc), rows, x.data_ptr(), positions.data_ptr(),
                             slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                             seq_lens.data_ptr(), None if lora is None else ctypes.addressof(lora),
                             scratch.data_ptr()):
            raise ValueError("decode_step does not serve this model's shapes")

    def decode_profile(self, on: bool) -> dict[str, float]:
        """Timing of the fused decode step's stages: on, every step from now adds each stage's wall time (its
        work and the barrier closing it); the call returns the seconds each stage took since the last call,
        and "steps", the steps they cover."""
        out = (ctypes.c_int64 * (len(DECODE_STAGES) + 1))()
        if self._decode_profile(int(on), out) != len(DECODE_STAGES):
            raise RuntimeError("the library's decode stages differ from DECODE_STAGES")
        n = len(DECODE_STAGES)
        return {name: out[i] / 1e9 for i, name in enumerate(DECODE_STAGES)} | {"steps": out[n]}

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of fp32 logits [rows, vocab] on the CPU: int64 [rows], the first index of each row's
        largest value, NaN never chosen, -1 for a row with nothing above -inf."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
            raise TypeError(f"argmax_rows needs fp32 [rows, vocab] logits on the CPU, got {logits.dtype} "
                            f"{tuple(logits.shape)} on {logits.device}")
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out

    # --- weight-only quantized matmuls on GGUF blocks (worker/model/quantized.py) --------------------
    def quant_matmul(self, x: torch.Tensor, w: torch.Tensor, type_id: int, out_dim: int, y: torch.Tensor,
                     int8_activations: bool = False) -> None:
        """y = x @ W.T: x fp32 [rows, in_dim] contiguous, w uint8 [out_dim, blocks] (ggml type type_id), y
        fp32 [rows, out_dim] contiguous. int8_activations: x rounded per 32-value block to int8 and integer
        dot products (llama.cpp's scheme; VNNI where the CPU has it)."""
        rows, in_dim = x.shape
        if not (x.dtype == y.dtype == torch.float32 and w.dtype == torch.uint8 and x.is_contiguous()
                and y.is_contiguous() and w.is_contiguous() and tuple(y.shape) == (rows, out_dim)):
            raise ValueError("quant_matmul needs contiguous fp32 x and y and uint8 blocks")
        fn = self._quant_matmul_q8act if int8_activations else self._quant_matmul
        rc = fn(x.data_ptr(), rows, in_dim, w.data_ptr(), out_dim, type_id, y.data_ptr())
        if rc == -2:
            raise MemoryError("quant_matmul could not allocate the quantized activations")
        if rc:
            raise ValueError(f"quant_matmul does not serve ggml type {type_id} with {in_dim} inputs")

    def quant_dequant(self, w: torch.Tensor, type_id: int, out_dim: int, in_dim: int,
                      out: torch.Tensor) -> None:
        """out (fp32 [out_dim, in_dim], contiguous) = the blocks of w dequantized."""
        if not (out.dtype == torch.float32 and out.is_contiguous() and w.is_contiguous()
                and out.numel() == out_dim * in_dim):
            raise ValueError("quant_dequant needs a contiguous fp32 output of out_dim x in_dim")
        if self._quant_dequant(w.data_ptr(), out_dim, in_dim, type_id, out.data_ptr()):
            raise ValueError(f"quant_dequant does not serve ggml type {type_id} with {in_dim} inputs")

    # packed_blocks.h's type ids: 16 rows interleaved, multiplied with 16-bit integer activations
    PACKED_Q4, PACKED_Q8, PACKED_Q4K, PACKED_Q6K, PACKED_Q5K = 100, 101, 102, 103, 104
    # ggml type -> (packed type, bytes a row per block, values a block): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
    _PACKABLE = {2: (PACKED_Q4, 20, 32), 3: (PACKED_Q4, 20, 32), 8: (PACKED_Q8, 34, 32),
                 12: (PACKED_Q4K, 152, 256), 13: (PACKED_Q5K, 184, 256), 14: (PACKED_Q6K, 212, 256)}

    def pack(self, w: torch.Tensor, type_id: int, out_dim: int, in_dim: int) -> tuple[torch.Tensor, int]:
        """Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks uint8 [out_dim, blocks] (out_dim a multiple of 16)
        -> (the packed layout of kernels/cpu/packed_blocks.h, uint8 [out_dim, in_dim / values * bytes], its
        type id), which quant_matmul and quant_dequant take (its rows are interleaved: it cannot be
        sliced)."""
        if not (w.dtype == torch.uint8 and w.is_contiguous() and w.device.type == "cpu"):
            raise ValueError("pack needs contiguous uint8 blocks on the CPU")
        packed, bb, values = self._PACKABLE.get(type_id, (0, 0, 32))
        out = torch.empty(out_dim, in_dim // values * bb, dtype=torch.uint8)
        if not packed or self._pack(w.data_ptr(), out_dim, in_dim, type_id, out.data_ptr()):
            raise ValueError("pack packs Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K matrices of whole 16-row "
                             f"groups, not type {type_id} {out_dim}x{in_dim}")
        return out, packed

    # --- the elementwise tail (fp32, contiguous rows; callers in worker/model/elementwise.py check) -
    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, eps: float) -> None:
        """residual += delta (when given, in place), out = rms_norm(residual) * weight."""
        rows, dim = residual.shape
        self._add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                           weight.data_ptr(), out.data_ptr(), rows, dim, float(eps))

    def add_rms_norm_mixed(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           out: torch.Tensor, eps: float) -> None:
        """add_rms_norm with the delta (or none) and out each fp32 or bf16, the residual fp32: residual +=
        delta widened, out = rms_norm(residual) * weight, rounded to bf16 where out is."""
        rows, dim = residual.shape
        bf16 = torch.bfloat16
        self._add_rms_norm_mixed(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                                 int(delta is not None and delta.dtype == bf16), weight.data_ptr(),
                                 out.data_ptr(), int(out.dtype == bf16), rows, dim, float(eps))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate_up[:, :I]) * gate_up[:, I:]: fp32, or bf16 in and out (computed in fp32, rounded
        to nearest even)."""
        rows, width = gate_up.shape
        fn = self._silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else self._silu_mul
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """Each token's k and v [tokens, n_kv_heads, head_dim] (fp32; views of one row layout, heads adjacent)
        into the pool [blocks, block_size, n_kv_heads, head_dim] (fp32 or bf16, contiguous) at its slot (-1:
        none). False, writing nothing, where the tensors are not of that form."""
        tokens, heads, dim = k.shape
        ok = (k.dtype == v.dtype == torch.float32 and k.stride() == v.stride() and k.stride(2) == 1
              and k.stride(1) == dim and k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
              and k_cache.is_contiguous() and v_cache.is_contiguous() and k.device.type == "cpu"
              and tuple(k_cache.shape[2:]) == (heads, dim) and tuple(v.shape) == tuple(k.shape)
              and slots.numel() == tokens)
        if not ok:
            return False
        slots = slots.to(torch.int64).contiguous()
        self._write_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                       slots.data_ptr(), tokens, heads * dim, int(k_cache.dtype == torch.bfloat16))
        return True

    def widen_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (bf16, contiguous) as a new fp32 tensor of its shape: exact."""
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.device.type == "cpu"):
            raise ValueError("widen_bf16 needs a contiguous bf16 tensor on the CPU")
        out = torch.empty(x.shape, dtype=torch.float32)
        self._widen_bf16(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def head_rms_norm(self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor,
                      eps: float) -> None:
        """RMSNorm in place of each of the first `heads` heads of each row of x [rows, >= heads *
        head_dim] (row stride x.stride(0), unit stride inside a row), weight [head_dim]."""
        self._head_rms_norm(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, weight.data_ptr(),
                            float(eps))

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row of x [rows, >= heads * head_dim]
        (row stride x.stride(0)); cos, sin: [max_pos, rotary_dim / 2] (the first rotary_dim values of each
        head rotate, the rest stay); positions int64 [rows]."""
        self._rope(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                   positions.data_ptr(), cos.shape[1])

    def prefill_tiles(self, use: bool | None = None) -> bool:
        """Whether bf16-dot-product prompt attention runs on AMX tiles (the CPU has them and the OS hands the
        process their state); `use` turns that on or off for the process (off: the vector kernel)."""
        return bool(self._prefill_tiles(-1 if use is None else int(use)))

    def paged_prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
        starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
        scale: float, window: int = 0, softcap: float = 0.0, bf16_dots: bool = False,
    ) -> None:
        """Causal attention of prompt chunks over their paged keys (a cached prefix included): for sequence i,
        query tokens starts[i] .. starts[i] + q_lens[i] - 1 of the step are its last q_lens[i] positions of
        seq_lens[i]. q: fp32 [num_tokens, n_heads, head_dim] with unit strides inside a token (a view of the
        fused QKV row works); out contiguous; starts int64, q_lens, seq_lens int32 [n]; block_tables int32;
        the caches fp32 or bf16 (both the same). window > 0: each query sees only its last `window` keys,
        itself included (sliding-window layers). softcap > 0: each scaled score s is softcap * tanh(s /
        softcap) (Gemma 2). bf16_dots, with a bf16 pool where `prefill_bf16_dots`: the scaled queries and the
        softmax weights rounded to bf16 and both products in bf16 dot products (fp32 sums), for a model served
        in bf16; elsewhere, or with an fp32 pool, the fp32 arithmetic."""
        n = starts.numel()
        if n == 0:
            return
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        kv = _kv_dtype(k_cache, v_cache, "paged_prefill")
        for t, dt in ((q, torch.float32), (out, torch.float32), (k_cache, kv), (v_cache, kv),
                      (starts, torch.int64), (q_lens, torch.int32), (seq_lens, torch.int32),
                      (block_tables, torch.int32)):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(f"paged_prefill needs {dt} tensors on the CPU, got {t.dtype} on {t.device}")
        if not (q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
                and k_cache.is_contiguous() and v_cache.is_contiguous() and starts.is_contiguous()
                and q_lens.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1):
            raise ValueError("paged_prefill needs each token's query heads contiguous and contiguous tensors")
        self._prefill(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                      starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0), n, q.shape[1], n_kv_heads, head_dim, block_size, float(scale),
                      int(window), float(softcap), int(kv == torch.bfloat16), int(bool(bf16_dots)))

    def supports_prefill(self, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        group = n_heads // n_kv_heads
        return (group <= 16 and head_dim <= self.prefill_max_head_dim
                and group * head_dim <= self.prefill_state)

    def supports(self, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None) -> bool:
        """dtype: the queries' (fp32); kv_dtype: the pool's (fp32 or bf16; None: dtype)."""
        return (dtype == torch.float32 and (kv_dtype or dtype) in KV_DTYPES and n_heads % n_kv_heads == 0
                and n_heads // n_kv_heads <= self.max_group
                and head_dim <= self.max_head_dim and block_size <= self.max_block)

    def paged_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
        rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """out[rows] = attention of q[rows] (one query token per sequence) over each sequence's paged keys
        (window > 0: its last `window` keys only; softcap > 0: scores soft-capped, as paged_prefill).

        q, out: fp32 [num_tokens, n_heads, head_dim] contiguous; rows: int64 [n]; block_tables: int32
        [n, max_blocks] (row stride may exceed max_blocks); seq_lens: int32 [n]; the caches fp32 or bf16.
        All on the CPU."""
        n = rows.numel()
        if n == 0:
            return
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        kv = _kv_dtype(k_cache, v_cache, "paged_decode")
        for t, dt in ((q, torch.float32), (out, torch.float32), (k_cache, kv), (v_cache, kv),
                      (rows, torch.int64), (seq_lens, torch.int32), (block_tables, torch.int32)):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(f"paged_decode needs {dt} tensors on the CPU, got {t.dtype} on {t.device}")
        if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
                and v_cache.is_contiguous() and rows.is_contiguous() and seq_lens.is_contiguous()
                and block_tables.stride(1) == 1):
            raise ValueError("paged_decode needs contiguous tensors")
        self._decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), rows.data_ptr(),
                     block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), n, q.shape[1],
                     n_kv_heads, head_dim, block_size, float(scale), int(window), float(softcap),
                     int(kv == torch.bfloat16))


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the attention kernels read a pool in (kv_rows.h)


def _kv_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> torch.dtype:
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{what} reads a KV pool of float32 or bfloat16 (K and V alike), got {k_cache.dtype} "
                        f"and {v_cache.dtype}")
    return k_cache.dtype


_LOADED: NativeKernels | None = None
_TRIED = False


def load() -> NativeKernels | None:
    """The native kernels, built if needed; None (logged once) where they cannot be built or loaded, or
    when PAGEDSERVE_NATIVE=0."""
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
