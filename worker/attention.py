"""Attention backends: how the model writes K/V into the pool and attends through block tables.

`torch` runs the pure-torch references of `kernels.reference` (the CPU default).
"""

from __future__ import annotations

import torch

from kernels import reference


class AttentionBackend:
    name = "abstract"

    def prepare(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
    ) -> object:
        """Per-step metadata, built once and shared by every layer."""
        raise NotImplementedError

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def forward(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, block_tables, seq_lens, query_start_loc, block_size):
        return reference.AttentionIndex(block_tables, seq_lens, query_start_loc, block_size, block_tables.device)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale):
        return reference.paged_attention_indexed(q, k_cache, v_cache, meta, scale)


BACKENDS = {"torch": TorchAttention}


def default_backend_name(device: torch.device) -> str:
    return "torch"


def make_backend(name: str | None, device: torch.device) -> AttentionBackend:
    name = name or default_backend_name(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
