"""Matmul libraries for the projections, chosen by timing each on
the model's own shapes at start.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("worker.model.linear")


class DenseMatmul:
    name = "dense"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDNNMatmul:
    """oneDNN with each weight reordered once: often 2-3x a plain fp32 matmul."""

    name = "onednn"

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cpu"
            and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware; elsewhere emulated, slower than fp32."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, c, lambda: False)()) for c in checks)


class OneDNNBf16Matmul:
    """A quantized file's bf16 copy for prompts (`--quantized-prefill bf16`): half fp32's bytes."""

    name = "onednn-bf16"

    @staticmethod
    def available() -> bool:
        return native_bf16() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

    @staticmethod
    def tiles() -> bool:
        """Whether the CPU multiplies bf16 in AMX tiles, where --quantized-prefill auto takes this
        copy.
        """
        return OneDNNBf16Matmul.available() and bool(
            getattr(torch.cpu, "_is_amx_tile_supported", bool)()
        )

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(torch.bfloat16).contiguous()
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        xb = x.contiguous().to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xb, weight, None, "none", [], "")
        return y.float() if bias is None else y.float().add_(bias)


# MKL's CBLAS enumerations
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151


def _mkl():
    """torch's CPU library where it exports MKL's packed-GEMM API, else None (once)."""
    global _MKL
    if _MKL is None:
        _MKL = False
        try:
            lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
            i, p = ctypes.c_int, ctypes.c_void_p
            lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
            lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
            lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, ctypes.c_float, p, i, p]
            lib.cblas_sgemm_pack.restype = None
            lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, ctypes.c_float, p, i]
            lib.cblas_sgemm_compute.restype = None
            _MKL = lib
        except (OSError, AttributeError):
            pass
    return _MKL or None


_MKL = None


class MKLPacked:
    """One weight [out, in] in MKL's packed layout for
    `cblas_sgemm_compute` (any number of rows).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        lib = _mkl()
        w = weight.detach().contiguous()
        out, k = w.shape
        self.shape = w.shape
        self.dtype, self.device = w.dtype, w.device
        nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, 1, out, k)
        # floats; the buffer's start aligned to 64 bytes
        self.buf = torch.empty((nbytes + 63) // 4 + 16)
        self.ptr = (self.buf.data_ptr() + 63) & ~63
        lib.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, 1, out, k, 1.0, w.data_ptr(), k, self.ptr
        )

    def dim(self) -> int:
        return 2


class MKLMatmul:
    """Weights packed once by MKL: 5-8% faster than oneDNN on prefill chunks, one more copy
    resident.
    """

    name = "mkl"

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and _mkl() is not None

    def prepare(self, weight: torch.Tensor) -> MKLPacked:
        return MKLPacked(weight)

    def __call__(
        self, x: torch.Tensor, weight: MKLPacked, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out, k = weight.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or x2.device.type != "cpu":
            raise TypeError(
                f"the mkl matmul multiplies fp32 on the CPU, got {x2.dtype} on {x2.device}"
            )
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], out)
        if x2.shape[0]:
            _MKL.cblas_sgemm_compute(
                _ROW_MAJOR,
                _NO_TRANS,
                _PACKED,
                x2.shape[0],
                out,
                k,
                x2.data_ptr(),
                k,
                weight.ptr,
                k,
                0.0,
                y.data_ptr(),
                out,
            )
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], out)


LIBRARIES = {"dense": DenseMatmul, "onednn": OneDNNMatmul, "mkl": MKLMatmul}


def head_library(lib, device: torch.device, dtype: torch.dtype):
    """oneDNN where it runs: its blocked layout reads a wide cold matrix fastest."""
    return (
        OneDNNMatmul()
        if lib.name in ("dense", "mkl") and OneDNNMatmul.available(device, dtype)
        else lib
    )


def measure(
    shapes: list[tuple[int, int]],
    rows: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    reps: int = 5,
) -> dict[str, float]:
    """Seconds each library takes per shape and row count, interleaved; raises on a wrong result."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(device, dtype) * k**-0.5 for n, k in shapes]
    inputs = {
        m: {k: torch.randn(m, k, generator=g).to(device, dtype) for _, k in shapes} for m in rows
    }
    libs = [DenseMatmul()] + [
        cls() for cls in (OneDNNMatmul, MKLMatmul) if cls.available(device, dtype)
    ]
    runs = {}
    for lib in libs:
        prepared = [lib.prepare(w) for w in weights]
        calls = [
            (lambda x=inputs[m][w.shape[1]], p=p, lib=lib: lib(x, p))
            for m in rows
            for w, p in zip(weights, prepared, strict=True)
        ]
        if lib.name != "dense":
            for m in rows:
                for w, p in zip(weights, prepared, strict=True):
                    x = inputs[m][w.shape[1]]
                    want = F.linear(x, w)
                    err = (lib(x, p) - want).abs().max().item() / max(
                        want.abs().max().item(), 1e-30
                    )
                    if err > 1e-4:
                        raise ArithmeticError(
                            f"{lib.name} matmul differs from F.linear by {err:.1e} (relative)"
                        )
        runs[lib.name] = lambda calls=calls: [call() for call in calls]
        runs[lib.name]()  # warm: first-call allocations and dispatch
    totals = {name: float("inf") for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            totals[name] = min(totals[name], time.perf_counter() - t)
    return totals


def best_time(fn, reps: int) -> float:
    """The best of `reps` timed calls of fn, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# the start-up measurement's prefill rows stay under this many multiply-adds x 2 a round
PROBE_FLOP = 30e9


def choose(name: str, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype):
    """`name` unless "auto", else the fastest measured on these shapes."""
    if name != "auto":
        if name not in LIBRARIES:
            raise ValueError(
                f"unknown matmul library {name!r}; choose from auto, {', '.join(LIBRARIES)}"
            )
        if name == "onednn" and not OneDNNMatmul.available(device, dtype):
            raise ValueError(
                f"the onednn matmul needs fp32 on a CPU with oneDNN, not {dtype} on {device}"
            )
        if name == "mkl" and not MKLMatmul.available(device, dtype):
            raise ValueError(
                f"the mkl matmul needs fp32 on a CPU and a torch built with MKL, not {dtype} on "
                f"{device}"
            )
        return LIBRARIES[name]()
    if not (OneDNNMatmul.available(device, dtype) or MKLMatmul.available(device, dtype)):
        return DenseMatmul()
    # decode rows and a prefill chunk's
    prefill_rows = 2048 if 2 * 2048 * sum(n * k for n, k in shapes) <= PROBE_FLOP else 512
    try:
        seconds = measure(shapes, (64, prefill_rows), device, dtype)
    except (RuntimeError, ArithmeticError) as e:
        log.warning("matmul_probe_failed", error=str(e))
        return DenseMatmul()
    best = min(seconds, key=seconds.get)
    log.info(
        "matmul_chosen", library=best, **{f"{k}_ms": round(v * 1e3, 2) for k, v in seconds.items()}
    )
    return LIBRARIES[best]()
