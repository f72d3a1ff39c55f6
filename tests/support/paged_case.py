"""Random paged-attention inputs with adversarial layout: blocks scattered and out of order (the
first and last block of the pool among them), everything not written poisoned with NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import write_kv


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens, n_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    @property
    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_case(
    q_lens,
    seq_lens,
    n_heads,
    n_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    seed=0,
    device="cpu",
    spare_blocks=3,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(needed) + 2
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=g).tolist()
    # make sure block 0 and the last block are used by someone
    for must in (num_blocks - 1, 0):
        order.remove(must)
        order.insert(0, must)
    used = 0
    for i, (s, n) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
        pos = torch.arange(s)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        write_kv(
            torch.randn(s, n_kv_heads, head_dim, generator=g).to(dtype),
            torch.randn(s, n_kv_heads, head_dim, generator=g).to(dtype),
            k_cache,
            v_cache,
            slots,
        )
    # unused table entries point at never-written (NaN) blocks rather than -1: they must not be read
    spare = order[used:]
    for i, n in enumerate(needed):
        tables[i, n:] = spare[i % len(spare)]
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    return PagedCase(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl.to(device),
        head_dim**-0.5,
    )
