"""Checkpoint tensors by name, read a slice at a time: a rank of a tensor-parallel group reads only
its rows or columns of each weight (lazily from safetensors files, without loading the rest)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

Range = tuple[int, int] | None


class TensorSource:
    """Hugging Face-named tensors; `get` returns rows [a, b) and/or columns [c, d) of one of them."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.names()


def range_index(rows: Range, cols: Range) -> tuple[slice, ...]:
    r = slice(*rows) if rows else slice(None)
    return (r,) if cols is None else (r, slice(*cols))


class DictSource(TensorSource):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name, rows=None, cols=None):
        return self.tensors[name][range_index(rows, cols)]


class SafetensorsSource(TensorSource):
    """A folder of safetensors files (sharded with model.safetensors.index.json, or not)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {folder}")
        self._handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self._file_of = {name: h for h in self._handles for name in h.keys()}

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name, rows=None, cols=None):
        if rows is None and cols is None:
            return self._file_of[name].get_tensor(name)
        return self._file_of[name].get_slice(name)[range_index(rows, cols)]
