"""A worker start's measurements (matmul library, quantized row threshold) kept per machine and
model (CPU, torch, native build, threads, shard, weights), so a second start skips the timing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog

from protos.base import env

log = structlog.get_logger("worker.serve.main")


def cpu_identity() -> str:
    """The CPU's model name and feature flags, as /proc/cpuinfo says them."""
    keep = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if (
                line.startswith(("model name", "flags", "Features", "CPU part"))
                and line not in keep
            ):
                keep.append(line)
    except OSError:
        pass
    return "\n".join(keep)


def weight_files(model: str) -> list[Path]:
    """The model's GGUF and safetensors files, and the GGUF a prepared folder names."""
    path = Path(model)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
    try:
        named = json.loads((path / "pagedserve_model.json").read_text()).get("gguf")
        if named:
            files.append(Path(named))
    except (OSError, ValueError):
        pass
    return files


def file_identity(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            st = f.resolve().stat()
            out.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            out.append(f"{f}:missing")
    return out


class StartCache:
    """The measured choices of one (machine, build, model, shard): get(name) before measuring,
    put(name, value) after.
    """

    def __init__(self, parts: dict, folder: Path | None = None) -> None:
        digest = hashlib.sha256(
            json.dumps(parts, sort_keys=True, default=str).encode()
        ).hexdigest()[:20]
        self.path = (folder or env.cache_dir() / "choices") / f"{digest}.json"
        try:
            self.values: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.values = {}

    def get(self, name: str):
        return self.values.get(name)

    def put(self, name: str, value) -> None:
        self.values[name] = value
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.values, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("start_cache_unwritable", path=str(self.path), error=str(e))


def start_cache(cfg, device, dtype, tp: int, prefill: str, activations: str) -> StartCache:
    """Choices an earlier start measured here for this model, shard and flags."""
    import torch

    from kernels.cpu_native import load as native

    lib = native() if device.type == "cpu" else None
    parts = {
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "native": str(lib.path) if lib else "",
        # BF16 rows on AMX tiles (2), dot products (1) or neither (0, a bench's comparison): their
        # thresholds differ
        "tiles": lib.bf16_rounded(-1) if lib else 0,
        "threads": torch.get_num_threads(),
        "tp": tp,
        "rank": cfg.rank,
        "files": file_identity(weight_files(cfg.model)),
        "device": str(device),
        "dtype": str(dtype),
        "prefill": prefill,
        "activations": activations,
        "cpu_decode": cfg.cpu_decode,
        "load_format": cfg.load_format,
    }
    return StartCache(parts)
