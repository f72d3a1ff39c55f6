"""The paged KV pool: per layer K and V as [blocks, block_size, kv_heads, head_dim]; the worker owns
the bytes, the scheduler who uses them.
"""

from __future__ import annotations

import torch

from worker.model.config import ModelConfig
from worker.model.state_pool import StatePool


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes of one block over all layers on one rank of a tensor-parallel group of tp."""
    element = torch.empty((), dtype=dtype).element_size()
    shapes = [config.kv_shape(i, tp) for i in range(config.num_layers)]
    return sum(2 * heads * dim * block_size * element for heads, dim in filter(None, shapes))


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: int = 1,
    ) -> None:
        """tp: the tensor-parallel group's size (a rank holds its slice of each layer's heads)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block(config, block_size, dtype, tp)
        # Never zeroed: attention masks by length. Each layer's own heads and head size (Gemma 4's
        # differ by layer type); a stateful layer keeps `states` instead, and a layer that reads
        # another's K/V (Gemma 4) holds none.
        shapes = [config.kv_shape(i, tp) for i in range(config.num_layers)]
        self.k = [self._empty(num_blocks, block_size, s, dtype, device) for s in shapes]
        self.v = [self._empty(num_blocks, block_size, s, dtype, device) for s in shapes]
        self.sources = [config.kv_source(i) for i in range(config.num_layers)]
        self.states: StatePool | None = None  # a hybrid's recurrent-state slots (use_states)
        # The token record: each slot's token id (plus a scratch slot), read by penalties.
        self._token_slots = torch.full(
            (num_blocks * block_size + 1,), -1, dtype=torch.int32, device=device
        )
        self.tokens = self._token_slots[:-1].view(num_blocks, block_size)

    @staticmethod
    def _empty(blocks, block_size, shape, dtype, device) -> torch.Tensor:
        size = (blocks, block_size, *shape) if shape else 0
        return torch.empty(size, dtype=dtype, device=device)

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V layer idx attends over: its own, or those of the layer it reads."""
        src = self.sources[idx]
        return self.k[src], self.v[src]

    @torch.no_grad()
    def copy_blocks(self, copies: torch.Tensor) -> None:
        """copies: int64 [num_copies, 2] of (src, dst); run before the forward (copy-on-write)."""
        if copies.numel() == 0:
            return
        src, dst = copies[:, 0], copies[:, 1]
        for k, v in zip(self.k, self.v, strict=True):
            if not k.numel():
                continue
            k[dst] = k[src]
            v[dst] = v[src]
        self.tokens[dst] = self.tokens[src]

    @torch.no_grad()
    def record_tokens(self, slot_mapping: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Write each token's id where its K/V goes (slot -1: nowhere), without a host sync."""
        scratch = torch.full_like(slot_mapping, self._token_slots.numel() - 1)
        self._token_slots[torch.where(slot_mapping >= 0, slot_mapping, scratch)] = token_ids.to(
            torch.int32
        )

    def context_tokens(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, pad: int
    ) -> torch.Tensor:
        """int64 [rows, max len]: each row's context read through its table, padded."""
        width = int(seq_lens.max()) if seq_lens.numel() else 0
        pos = torch.arange(width, device=block_tables.device)
        blocks = pos // self.block_size
        table = block_tables[:, : blocks[-1] + 1 if width else 0].long().clamp(min=0)
        ids = self.tokens[table[:, blocks], pos % self.block_size].long()
        return torch.where(pos[None, :] < seq_lens[:, None], ids, torch.full_like(ids, pad))
