"""Matmul libraries for the projections, chosen by measurement when the worker starts.

`dense`: F.linear on the weights as loaded (cuBLAS on a GPU, MKL or OpenBLAS on a CPU).
`onednn`: on CPUs, oneDNN with each weight reordered once into the blocked layout its kernels read
(`torch.ops.mkldnn._reorder_linear_weight`); the same fp32 arithmetic, often 2-3x the rate of a
plain matmul because no step re-packs the weight. Which one wins differs between machines (AVX2 vs
AVX-512, core counts), so `choose()` times both on the model's own shapes, at decode and at prefill
row counts, checks the packed result against F.linear, and keeps the faster.
"""

from __future__ import annotations

import time

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("worker.linear")


class DenseMatmul:
    name = "dense"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDNNMatmul:
    name = "onednn"

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


LIBRARIES = {"dense": DenseMatmul, "onednn": OneDNNMatmul}


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...], device: torch.device, dtype: torch.dtype,
            reps: int = 3) -> dict[str, float]:
    """Seconds each available library takes for every (out, in) weight shape at every row count (the best
    of `reps`), and raises if the packed result strays from F.linear beyond fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(device, dtype) * k**-0.5 for n, k in shapes]
    inputs = {m: {k: torch.randn(m, k, generator=g).to(device, dtype) for _, k in shapes} for m in rows}
    libs = [DenseMatmul()] + ([OneDNNMatmul()] if OneDNNMatmul.available(device, dtype) else [])
    totals = {}
    for lib in libs:
        prepared = [lib.prepare(w) for w in weights]
        total = 0.0
        for m in rows:
            for w, p in zip(weights, prepared, strict=True):
                x = inputs[m][w.shape[1]]
                total += _time(lambda x=x, p=p, lib=lib: lib(x, p), reps)
                if lib.name != "dense":
                    want = F.linear(x, w)
                    err = (lib(x, p) - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    if err > 1e-4:
                        raise ArithmeticError(f"{lib.name} matmul differs from F.linear by {err:.1e} (relative)")
        totals[lib.name] = total
    return totals


def choose(name: str, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype):
    """The library to use: `name` if it is not "auto", else the fastest on these shapes by measurement."""
    if name != "auto":
        if name not in LIBRARIES:
            raise ValueError(f"unknown matmul library {name!r}; choose from auto, {', '.join(LIBRARIES)}")
        if name == "onednn" and not OneDNNMatmul.available(device, dtype):
            raise ValueError(f"the onednn matmul needs fp32 on a CPU with oneDNN, not {dtype} on {device}")
        return LIBRARIES[name]()
    if not OneDNNMatmul.available(device, dtype):
        return DenseMatmul()
    try:
        seconds = measure(shapes, (64, 512), device, dtype)
    except (RuntimeError, ArithmeticError) as e:
        log.warning("matmul_probe_failed", error=str(e))
        return DenseMatmul()
    best = min(seconds, key=seconds.get)
    log.info("matmul_chosen", library=best, **{f"{k}_ms": round(v * 1e3, 2) for k, v in seconds.items()})
    return LIBRARIES[best]()
