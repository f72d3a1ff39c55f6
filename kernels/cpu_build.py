"""Build kernels/cpu/*.c for this machine (-O3 -march=native -fopenmp), cached under
$PAGEDSERVE_CACHE by a hash of the sources, flags, compiler and CPU features, so each vector unit
gets its own copy.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from protos.base import env

SOURCE_DIR = Path(__file__).with_name("cpu")


def sources(folder: Path = SOURCE_DIR) -> list[Path]:
    """Every translation unit of the library: each .c in the folder."""
    return sorted(folder.glob("*.c"))


def build_inputs(folder: Path = SOURCE_DIR) -> list[Path]:
    """Every .c and .h the library depends on: an edited header rebuilds."""
    return sorted([*folder.glob("*.c"), *folder.glob("*.h")])


# PAGEDSERVE_NATIVE_MARCH builds for another target (x86-64-v3: AVX2 only; tests use it to check the
# portable paths)
MARCH = env.native_march()
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-std=c11"]
if platform.machine() in ("x86_64", "AMD64"):
    # full-width vectors where AVX-512 exists; no effect elsewhere
    CFLAGS.append("-mprefer-vector-width=512")
# PAGEDSERVE_NATIVE_SANITIZE=1 builds with ASan and UBSan (`make test-sanitize`)
SANITIZE = env.native_sanitize()
if SANITIZE:
    CFLAGS += [
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
        "-g",
    ]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return env.c_compiler() or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> Path:
    return env.cache_dir() / "kernels"


def build_key(cc: str, folder: Path = SOURCE_DIR, cflags: list[str] = CFLAGS) -> str:
    """A hash of sources, flags, compiler and CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[
        :1
    ]
    digest = hashlib.sha256()
    for f in build_inputs(folder):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (" ".join(cflags), str(version), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile once per source, compiler and CPU -> the library's path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    target = cache_dir() / f"pagedserve_cpu-{build_key(cc)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built aside, then renamed: ranks may race
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *CFLAGS, *map(str, sources()), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"building the native CPU kernels failed: {res.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if verbose:
        print(f"built {target}")
    return target
