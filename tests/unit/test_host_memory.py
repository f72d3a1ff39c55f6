"""The worker's host allocator (serve/host_memory.py): a process asks for one and ends up running on
it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.serve.host_memory import find_tcmalloc, resolve_mode, wants_tcmalloc

ROOT = Path(__file__).resolve().parents[2]


def allocator_of(mode: str, **env) -> str:
    """Start `python -m worker.serve.host_memory MODE` (it re-executes itself where needed), read
    its answer.
    """
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PAGEDSERVE_MALLOC_REEXEC")
    }
    out = subprocess.run(
        [sys.executable, "-m", "worker.serve.host_memory", mode],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def test_auto_runs_on_tcmalloc_where_the_system_has_it_else_on_tuned_glibc():
    expected = "tcmalloc" if find_tcmalloc() else "glibc (tuned)"
    assert allocator_of("auto") == expected


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc on this system")
def test_tcmalloc_is_preloaded_once_and_not_again_when_already_there():
    assert allocator_of("tcmalloc") == "tcmalloc"
    # a process started with it already preloaded keeps it and does not re-execute
    assert allocator_of("tcmalloc", LD_PRELOAD=find_tcmalloc()) == "tcmalloc"


def test_glibc_and_default_modes():
    assert allocator_of("glibc") == "glibc (tuned)"
    assert allocator_of("default") == "glibc"


def test_mode_from_the_environment_and_bad_modes(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MALLOC", "glibc")
    assert resolve_mode(None) == "glibc"
    assert resolve_mode("default") == "default"
    with pytest.raises(ValueError, match="unknown malloc mode 'fast'"):
        resolve_mode("fast")


def test_auto_wants_tcmalloc_only_for_cpu_workers():
    assert wants_tcmalloc("auto", "cpu")
    assert not wants_tcmalloc("auto", "cuda:0")
    assert wants_tcmalloc("tcmalloc", "cuda")
    assert not wants_tcmalloc("glibc", "cpu")


def _huge_bytes_at(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr, in bytes (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's smaps only")
def test_weights_are_moved_onto_huge_pages_with_their_values_kept():
    """A written weight's 2 MiB-aligned interior is advised and collapsed onto 2 MiB pages (where
    the system has them at all), its values untouched; a small tensor, the same storage twice and a
    library's own packed weight (not a tensor) are left alone.
    """
    import torch

    from worker.serve.host_memory import HUGE_PAGE, huge_pages

    w = torch.randn(6 * HUGE_PAGE // 4)
    want = w.clone()
    ptr, end = w.data_ptr(), w.data_ptr() + w.numel() * 4
    interior = end // HUGE_PAGE * HUGE_PAGE - -(-ptr // HUGE_PAGE) * HUGE_PAGE
    advised = huge_pages([w, w[10:], torch.ones(100), None, object()], collapse=True)
    assert advised == interior >= 4 * HUGE_PAGE
    assert torch.equal(w, want)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _huge_bytes_at(ptr + HUGE_PAGE) >= HUGE_PAGE


LOAD_THEN_RELEASE = """
import torch
from worker.serve.host_memory import loaded_allocator, release_free_memory, tune_glibc
from worker.serve.memory_plan import resident_bytes
if loaded_allocator() == "glibc":
    tune_glibc()  # as a worker on glibc runs: freed blocks kept
held = [torch.ones(1 << 19) for _ in range(200)]  # 2 MiB each: 400 MiB of loading's transients
del held
kept = resident_bytes()[0]
assert release_free_memory()
print(loaded_allocator(), kept - resident_bytes()[0])
"""


@pytest.mark.parametrize("allocator", ["tcmalloc", "glibc"])
def test_what_loading_freed_is_given_back_to_the_system(allocator):
    """The allocators a worker runs on keep freed memory for reuse (what a step's scratch wants), so
    loading's transients would stay resident beside the model for good: released once, after
    loading.
    """
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PAGEDSERVE_MALLOC_REEXEC")
    }
    if allocator == "tcmalloc":
        if find_tcmalloc() is None:
            pytest.skip("no tcmalloc on this system")
        clean["LD_PRELOAD"] = find_tcmalloc()
    out = subprocess.run(
        [sys.executable, "-c", LOAD_THEN_RELEASE],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert out[0] == allocator
    assert int(out[1]) > 300 << 20  # of the 400 MiB freed
