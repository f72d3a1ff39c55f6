"""The paged KV pool: per layer K and V in the block-tensor layout
[num_blocks, block_size, n_kv_heads, head_dim]. The worker owns the bytes; the scheduler owns who uses them."""

from __future__ import annotations

import re

import torch

from worker.model_config import ModelConfig

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one block over all layers; num_kv_heads: the heads this rank holds (default: all)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * config.num_layers * heads * config.head_dim * block_size * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        """num_kv_heads: the KV heads this rank holds (a tensor-parallel rank holds its slice)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        self.bytes_per_block = bytes_per_block(config, block_size, dtype, heads)
        shape = (num_blocks, block_size, heads, config.head_dim)
        # Never zeroed: attention masks by sequence length, so stale bytes are never read.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[idx], self.v[idx]

    @torch.no_grad()
    def copy_blocks(self, copies: torch.Tensor) -> None:
        """copies: int64 [num_copies, 2] of (src, dst); run before the forward (copy-on-write)."""
        if copies.numel() == 0:
            return
        src, dst = copies[:, 0], copies[:, 1]
        for k, v in zip(self.k, self.v, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]
