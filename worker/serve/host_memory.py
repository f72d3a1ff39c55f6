"""The host allocator a worker runs on: tcmalloc where the system has it, else glibc tuned to keep freed
blocks, so a CPU forward's tens of MiB a layer are not given back to the kernel and faulted in again every
step. `--malloc` / PAGEDSERVE_MALLOC: auto, tcmalloc, glibc, default (malloc as it is, for comparisons).
The weights are moved onto 2 MiB pages once loaded (huge_pages).

    python -m worker.serve.host_memory [MODE]   # prints the allocator this process ends up with"""

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
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")

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
    """Keep freed large blocks in glibc's heap for reuse; False where the C library has no mallopt."""
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
    """auto: a CPU worker (an explicit cpu device, or no GPU on the host) on a system that has tcmalloc."""
    if mode == "tcmalloc":
        return True
    if mode != "auto":
        return False
    if device is not None:
        return device.startswith("cpu")
    return not os.path.exists("/dev/nvidiactl")


def ensure_allocator(mode: str, device: str | None, module: str, argv: list[str]) -> str:
    """Why: at a 2048-token prefill chunk of the default model the MLP's gate/up activation alone is 25 MiB.
    glibc's malloc serves large blocks with fresh mmaps and trims the top of its heap when enough is free,
    so the same memory is faulted in again, zero-filled, page by page, every layer of every step: measured
    on a 2-core AVX-512 machine, 28% of a prefill chunk went there (docs/BENCHMARKS.md). tcmalloc keeps
    freed spans for reuse and is faster still for torch's many small allocations, but must be in place
    before the process starts, hence the re-execution; glibc is tuned with mallopt (the mmap threshold at
    its maximum, 32 MiB, and no trimming).

    Called first thing in a process's main: with tcmalloc wanted and found but not loaded, re-execute
    `python -m module argv` with it preloaded (this call then never returns); otherwise tune glibc unless
    mode is 'default'. Returns what the process runs on, for the start-up log."""
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
    """Give the system back what the allocator holds free: loading's transients (each matrix read, then
    packed; the file's header), which a tcmalloc or an untrimmed glibc keeps for reuse: 0.3-0.7 GiB at 8B.
    Called once, after loading and before the KV pool and the warm-up: what the steps reuse is taken again
    by the warm-up and kept. Whether the allocator had a way to."""
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
    """Back these CPU tensors' memory with 2 MiB pages, each storage's 2 MiB-aligned interior: MADV_HUGEPAGE
    (pages faulted from now on come huge, the KV pool's), and with `collapse` MADV_COLLAPSE too (the pages
    already written are merged now: the weights'). A decode step streams every weight once and 4 KiB pages
    cost it a TLB walk each: 5-15% of a 1B step where the system leaves huge pages to madvise. Best effort:
    where the kernel refuses (huge pages off, an older kernel) nothing changes. -> bytes advised."""
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
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
    """The tensors a decode step streams: every parameter, and each quantized projection's blocks. Not a
    quantized projection's dense copy: it serves steps past the kernels' rows, whose products reuse each
    weight row across many rows, and moving it onto huge pages costs start-up a second a 300 MB."""
    import torch

    from worker.model.quantized import QuantLinear

    out = list(model.parameters())
    for w in [*(w for layer in model.layers for w in layer.w.values()), getattr(model, "head", None)]:
        if isinstance(w, QuantLinear):
            out += [p.data for p in w.q.segments]
        elif hasattr(w, "segments"):
            out += [p.data for p in w.segments]
        elif isinstance(w, torch.Tensor):
            out.append(w)
    return out
