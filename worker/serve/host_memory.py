"""The worker's host allocator: tcmalloc where present, else glibc tuned to keep freed blocks, so a
forward's buffers are not faulted in every step; weights on 2 MiB pages.

python -m worker.serve.host_memory [MODE] # prints the allocator this process ends up with
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

from protos.base import env

MODES = ("auto", "tcmalloc", "glibc", "default")
_REEXEC_GUARD = "PAGEDSERVE_MALLOC_REEXEC"
_TCMALLOC_GLOBS = ("libtcmalloc_minimal.so*", "libtcmalloc.so*")
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_TOP_PAD = 64 << 20
_NO_TRIM = (1 << 31) - 1  # mallopt takes an int


def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library on this system, or None."""
    for pattern in _TCMALLOC_GLOBS:
        for d in _LIB_DIRS:
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits[0]
    for name in ("tcmalloc_minimal", "tcmalloc"):
        soname = ctypes.util.find_library(name)
        if soname:
            return soname
    return None


def loaded_allocator() -> str:
    """'tcmalloc', 'jemalloc' or 'glibc': the malloc this process is running on."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "glibc"
    for name in ("tcmalloc", "jemalloc"):
        if name in maps:
            return name
    return "glibc"


def tune_glibc() -> bool:
    """Keep freed large blocks in glibc's heap; False without mallopt."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, _NO_TRIM) == 1
    ok &= mallopt(_M_TOP_PAD, _TOP_PAD) == 1
    return bool(ok)


def resolve_mode(mode: str | None) -> str:
    mode = mode or env.malloc()
    if mode not in MODES:
        raise ValueError(f"unknown malloc mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def wants_tcmalloc(mode: str, device: str | None) -> bool:
    """auto: a CPU worker on a system that has tcmalloc."""
    if mode == "tcmalloc":
        return True
    if mode != "auto":
        return False
    if device is not None:
        return device.startswith("cpu")
    return not os.path.exists("/dev/nvidiactl")


def ensure_allocator(mode: str, device: str | None, module: str, argv: list[str]) -> str:
    """Re-exec with tcmalloc where wanted (never returns), else tune glibc -> what runs."""
    current = loaded_allocator()
    if current != "glibc":
        return current
    if wants_tcmalloc(mode, device) and not env.malloc_reexec():
        lib = find_tcmalloc()
        if lib is not None:
            child = dict(os.environ)
            child["LD_PRELOAD"] = " ".join(filter(None, (lib, child.get("LD_PRELOAD", ""))))
            child[_REEXEC_GUARD] = "1"  # once: if the library did not take, go on with glibc
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                os.execve(sys.executable, [sys.executable, "-m", module, *argv], child)
            except OSError:
                pass
    if mode == "default":
        return "glibc"
    return "glibc (tuned)" if tune_glibc() else "glibc"


def release_free_memory() -> bool:
    """Give back the allocator's free memory after loading (0.3-0.7 GiB at 8B)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    release = getattr(libc, "MallocExtension_ReleaseFreeMemory", None)  # tcmalloc (gperftools)
    if release is not None:
        release.argtypes, release.restype = (), None
        release()
        return True
    trim = getattr(libc, "malloc_trim", None)  # glibc
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode = resolve_mode(argv[0] if argv else None)
    print(ensure_allocator(mode, "cpu", "worker.serve.host_memory", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())


MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's madvise advice values
HUGE_PAGE = 2 << 20


def huge_pages(tensors, collapse: bool) -> int:
    """Advise 2 MiB pages (4 KiB pages cost a decode 5-15% in TLB walks) -> bytes advised."""
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = (
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
        ctypes.c_int,
    )
    advised, seen = 0, set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_mkldnn:
            continue  # a library's own packed weight (MKL's, oneDNN's) is not ours to advise
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        start, end = -(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + size) // HUGE_PAGE * HUGE_PAGE
        if end - start < HUGE_PAGE or start in seen:
            continue
        seen.add(start)
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue
        if collapse:
            madvise(start, end - start, MADV_COLLAPSE)
        advised += end - start
    return advised


def weight_tensors(model) -> list:
    """The tensors a decode step streams (parameters, quantized
    blocks), not prefill's dense copies.
    """
    import torch

    from worker.model.quant_weights import QuantLinear

    out = list(model.parameters())
    for w in [
        *(w for layer in model.layers for w in layer.w.values()),
        getattr(model, "head", None),
    ]:
        if isinstance(w, QuantLinear):
            out += [p.data for p in w.q.segments]
        elif hasattr(w, "segments"):
            out += [p.data for p in w.segments]
        elif isinstance(w, torch.Tensor):
            out.append(w)
    return out
