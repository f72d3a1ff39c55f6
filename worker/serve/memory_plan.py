"""What a CPU worker will hold in host memory, checked before it is taken: a model that does not fit
is refused at start with the bytes it needs, never killed by the OOM killer halfway.
"""

from __future__ import annotations

import resource
from pathlib import Path

GiB = 1 << 30
MARGIN = 2 * GiB  # activations, scratch, the allocator's slack, the scheduler beside the worker
# The most a dense prefill copy may hold under auto: a server holds its file, its pool and about 1
# GiB (as llama.cpp does), so the copy is for small models only.
DENSE_COPY_LIMIT = GiB


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable (what can be taken without swapping), or None where the system does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process."""
    fields = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    # not Linux: the peak getrusage reports (kilobytes on Linux, bytes on macOS)
    if len(fields) < 2:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak, peak
    return fields["VmRSS"], max(fields["VmHWM"], fields["VmRSS"])


def human(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def weight_bytes(num_params: int, element_size: int) -> int:
    return num_params * element_size


def check_fits(what: str, need: int, available: int | None, fix: str) -> str | None:
    """None if `need` bytes fit in available memory, else the refusal."""
    if available is None or need <= available:
        return None
    return (
        f"{what} needs {human(need)} of memory and this machine has {human(available)} "
        f"available; {fix}"
    )


def choose_quantized_prefill(
    choice: str, dense_copy: int, kv: int, available: int | None, bf16: bool = False
) -> tuple[str, str]:
    """--quantized-prefill auto: a dense copy only where it, the pool and a margin fit, and why."""
    if choice != "auto":
        return choice, "asked for"
    if bf16:
        chosen, why = choose_quantized_prefill(choice, dense_copy // 2, kv, available)
        return ("bf16", f"AMX multiplies bf16; {why}") if chosen == "dense" else (chosen, why)
    if dense_copy > DENSE_COPY_LIMIT:
        return "dequantize", (
            f"a dense copy ({human(dense_copy)}) would hold more than "
            f"{human(DENSE_COPY_LIMIT)} beside the file (--quantized-prefill dense keeps "
            "one)"
        )
    if available is None:
        return "dense", "the system does not report its available memory"
    need = dense_copy + kv + MARGIN
    if need <= available:
        return "dense", (
            f"{human(available)} available holds a dense copy ({human(dense_copy)}), the KV "
            f"pool and {human(MARGIN)} beside the blocks"
        )
    return "dequantize", (
        f"{human(available)} available cannot hold a dense copy ({human(dense_copy)}), the "
        f"KV pool ({human(kv)}) and {human(MARGIN)} beside the blocks"
    )


def choose_gemm_copy(copy: int, kv: int, available: int | None) -> tuple[bool, str]:
    """Whether bf16 weights get a GEMM copy (where it fits), and why."""
    if available is None:
        return False, "the system does not report its available memory"
    if copy + kv + MARGIN <= available:
        return (
            True,
            (
                f"{human(available)} available holds it ({human(copy)}), the KV pool and "
                f"{human(MARGIN)}"
            ),
        )
    return False, (
        f"{human(available)} available cannot hold it ({human(copy)}), the KV pool ({human(kv)}) "
        f"and {human(MARGIN)}: the GEMM reorders each weight as it multiplies"
    )


def dense_copy_bytes(weights: dict) -> int:
    """What prefill's dense fp32 copy of the file's matrices would hold."""
    # experts never get one: they are most of an MoE's bytes, and each reads few rows a step
    return sum(
        4 * w.out_dim * w.in_dim
        for key, w in weights.items()
        if key != ("embed",) and key[1:] != ("experts",)
    )
