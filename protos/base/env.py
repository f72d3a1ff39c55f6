"""Every environment variable pagedserve reads, each read when asked and with its default. Flags
win; these are for what a deployment sets once and for the processes pagedserve starts.
"""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name) or default


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the bearer token the OpenAI API asks for (--api-key)."""
    return _get("PAGEDSERVE_API_KEY") or None


def server() -> str:
    """PAGEDSERVE_SERVER: the gRPC address client commands talk to (--server)."""
    return _get("PAGEDSERVE_SERVER", "127.0.0.1:50051")


def supervised() -> bool:
    """PAGEDSERVE_SUPERVISED=1: this worker runs under deploy/supervisor.py
    (set by the supervisor).
    """
    return _get("PAGEDSERVE_SUPERVISED") == "1"


def malloc() -> str:
    """PAGEDSERVE_MALLOC: the worker's host allocator (--malloc): auto,
    tcmalloc, glibc or default.
    """
    return _get("PAGEDSERVE_MALLOC", "auto")


def malloc_reexec() -> bool:
    """PAGEDSERVE_MALLOC_REEXEC: set by a worker that re-executed itself onto tcmalloc (so once
    only).
    """
    return bool(_get("PAGEDSERVE_MALLOC_REEXEC"))


def cache_dir() -> Path:
    """PAGEDSERVE_CACHE: where built kernels and prepared models are kept (~/.cache/pagedserve)."""
    return Path(_get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def models_dir() -> Path:
    """PAGEDSERVE_MODELS: where prepared models are kept (under the cache folder)."""
    return Path(_get("PAGEDSERVE_MODELS") or cache_dir() / "models")


def native_kernels() -> bool:
    """PAGEDSERVE_NATIVE=0 turns the native CPU kernels off (the torch paths run)."""
    return _get("PAGEDSERVE_NATIVE", "1") != "0"


def native_march() -> str:
    """PAGEDSERVE_NATIVE_MARCH: the -march the native library is built for (native: this CPU)."""
    return _get("PAGEDSERVE_NATIVE_MARCH", "native")


def native_sanitize() -> bool:
    """PAGEDSERVE_NATIVE_SANITIZE=1: build the native library with ASan and UBSan (make
    test-sanitize).
    """
    return _get("PAGEDSERVE_NATIVE_SANITIZE") == "1"


def c_compiler() -> str:
    """CC, else cc, gcc or clang from PATH."""
    return _get("CC")


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter (on a CPU, the tests)."""
    return _get("TRITON_INTERPRET") == "1"
